"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws each token from a generator seeded by (seed, output position), so the
same request gives the same tokens whether it ran aggregated, was preempted and recomputed, or
had its first token sampled on a prefill instance and the rest on a decode instance.

Logprobs are computed only for the rows whose request asked, from the raw logits.
"""

from __future__ import annotations

import torch

from disagg.protocol import SamplingParams, TokenLogprobs

__all__ = ["Sampler"]

_SEED_STRIDE = 1_000_003  # keeps (seed, position) pairs apart in the generator's seed space
# -inf (a token the model rules out) is not JSON; vLLM's server reports such tokens as -9999.
_MIN_LOGPROB = -9999.0


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

    def logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], tokens: list[int | None]
    ) -> list[TokenLogprobs | None]:
        """logits [B, vocab] and the tokens sampled from them -> per row its TokenLogprobs, or
        None for a row that did not ask (or failed to sample). Rows that did not ask cost
        nothing; the rest share one log_softmax, one top-k and two host copies.

        Of the raw model distribution, before temperature / top-k / top-p, as vLLM returns
        logprobs by default: the numbers do not depend on how the token was drawn."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] is not None]
        if not rows:
            return [None] * len(params)
        index = torch.tensor(rows, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, V]
        sampled = torch.tensor([tokens[i] for i in rows], device=logits.device)
        chosen = logprobs.gather(1, sampled[:, None])  # [R, 1]
        k = min(max(params[i].logprobs or 0 for i in rows), logprobs.shape[-1])
        top = torch.topk(logprobs, k, dim=-1)  # [R, k]: k <= MAX_LOGPROBS, never the vocab
        values = torch.cat((chosen, top.values), dim=1).clamp_(min=_MIN_LOGPROB).tolist()
        top_ids = top.indices.tolist()
        out: list[TokenLogprobs | None] = [None] * len(params)
        for r, i in enumerate(rows):
            n = params[i].logprobs or 0
            out[i] = TokenLogprobs(values[r][0], top_ids[r][:n], values[r][1 : n + 1])
        return out

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
