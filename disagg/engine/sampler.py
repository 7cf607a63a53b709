"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws each token from a generator seeded by (seed, output position), so the
same request gives the same tokens whether it ran aggregated, was preempted and recomputed, or
had its first token sampled on a prefill instance and the rest on a decode instance.
"""

from __future__ import annotations

import torch

from disagg.protocol import SamplingParams

__all__ = ["Sampler"]

_SEED_STRIDE = 1_000_003  # keeps (seed, position) pairs apart in the generator's seed space


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)  # the stream for requests without a seed

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> list[int | None]:
        """logits [B, vocab] fp32 -> one token id per row; None for a row whose parameters
        leave no valid distribution (that request fails alone, the batch goes on)."""
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1).tolist()  # one host sync for the whole batch
        return [self._sample_row(logits[i], p, output_indices[i]) for i, p in enumerate(params)]

    def _sample_row(
        self, logits: torch.Tensor, params: SamplingParams, position: int
    ) -> int | None:
        if params.is_greedy:
            return int(logits.argmax())
        logits = logits.float() / params.temperature
        if params.top_k is not None and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            probs = _top_p(probs, params.top_p)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return None  # multinomial would raise, and take the engine loop with it
        return int(torch.multinomial(probs, 1, generator=self._generator_for(params, position)))

    def _generator_for(self, params: SamplingParams, position: int) -> torch.Generator:
        if params.seed is None:
            return self._generator
        generator = torch.Generator(device=self.device)
        generator.manual_seed((params.seed * _SEED_STRIDE + position) % (2**63))
        return generator


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (the top token always stays)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    is_dropped = mass_before >= top_p
    # Kept by index, not by the comparison: a top_p below float32's range (1e-300) rounds to 0
    # there, and 0 >= 0 would drop the top token too, leaving nothing to sample.
    is_dropped[..., 0] = False
    sorted_probs = sorted_probs.masked_fill(is_dropped, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
