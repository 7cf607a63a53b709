"""Attention over the paged KV cache without the gather, on CPU: kernels of our own
(csrc/paged_decode.cpp, csrc/paged_prefill.cpp), built at first use and called through ctypes.

Why kernels of our own (measured on the development CPU, one thread, SmolLM2-135M shapes,
`python benchmarks/attention_bench.py`):
- decode: the torch path gathers every decode's blocks into one contiguous copy per layer
  (index_select), then runs two batched GEMMs (bf16) or SDPA (fp32) on it; the gather alone
  was ~20% of a batch-32 step. The kernel reads each key and value row once, in place, and
  scores the query heads that share a KV head together.
- prefill: SDPA's causal flash kernel ran at ~30-45 GFLOP/s here, a tenth of the GEMMs' rate,
  and needs the KV heads repeated for GQA (and a gather after a cached prefix). Ours tiles 16
  tokens x the query heads of one KV head against fp32 key panels, 2-2.6x faster.
torch's flex_attention cannot stand in: it wants K/V as one [B, H, S, D] tensor per layer, and
our cache holds all layers of a block together (one transfer descriptor per block), so a
layer's keys are no single strided view.

Built with the other CPU kernels (cpu_kernels.py). Without a compiler, or on CUDA, or for fp16,
the torch path runs.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch

from disagg.engine.cpu_kernels import KERNEL_DTYPES, load_library

__all__ = ["PagedAttention", "make_paged_attention"]

log = logging.getLogger(__name__)


class PagedAttention:
    """The kernels bound to one cache: `decode` for a batch of one-token sequences, `prefill`
    for one sequence's chunk of new tokens (its K/V already written to the cache)."""

    def __init__(self, lib: ctypes.CDLL, kv_cache: torch.Tensor, num_heads: int) -> None:
        self._decode = lib.disagg_paged_decode
        self._prefill = lib.disagg_paged_prefill
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, Hkv, block_size, D], contiguous
        _, self.num_layers, _, self.num_kv_heads, self.block_size, self.head_dim = kv_cache.shape
        self.num_heads = num_heads
        self.is_bf16 = KERNEL_DTYPES[kv_cache.dtype]
        self.scale = self.head_dim**-0.5

    def decode(
        self, layer: int, q: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """q [B, Hq, D]; table [B, W] long block ids; lens [B] long keys each -> [B, Hq, D]."""
        return self._run(
            self._decode, "decode", q, table.data_ptr(), lens.data_ptr(), q.shape[0],
            self.num_heads, self.num_kv_heads, self.head_dim, self.num_layers, self.block_size,
            table.shape[1], layer, self.scale, self.is_bf16, torch.get_num_threads(),
        )  # fmt: skip

    def prefill(
        self, layer: int, q: torch.Tensor, blocks: torch.Tensor, start_pos: int
    ) -> torch.Tensor:
        """q [n, Hq, D], the tokens at positions start_pos .. start_pos + n - 1; blocks [nb]
        long, the sequence's blocks covering start_pos + n keys -> [n, Hq, D], causal."""
        return self._run(
            self._prefill, "prefill", q, blocks.data_ptr(), q.shape[0], start_pos,
            self.num_heads, self.num_kv_heads, self.head_dim, self.num_layers, self.block_size,
            layer, self.scale, self.is_bf16, torch.get_num_threads(),
        )  # fmt: skip

    def _run(
        self, kernel: Callable[..., int], name: str, q: torch.Tensor, *args: object
    ) -> torch.Tensor:
        """Call `kernel(q, cache, out, *args)` into a fresh output shaped as q."""
        q = q.contiguous()
        out = torch.empty_like(q)
        status = kernel(q.data_ptr(), self.kv_cache.data_ptr(), out.data_ptr(), *args)
        if status != 0:
            raise RuntimeError(f"paged {name} kernel refused its shapes (status {status})")
        return out


def make_paged_attention(
    backend: str, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int
) -> PagedAttention | None:
    """The kernel for this cache, or None where the torch path must run. `backend`: "auto"
    (the kernel where it can run), "native" (the kernel or ValueError), "torch" (None)."""
    if backend == "torch":
        return None
    reason = _unusable(kv_cache, num_heads, num_kv_heads)
    lib = None if reason else load_library()
    if reason is None and lib is None:
        reason = "the kernels did not build (see the warning above)"
    if reason is None and not lib.disagg_paged_decode_supports(
        num_heads // num_kv_heads, kv_cache.shape[-1]
    ):
        reason = f"no kernel for {num_heads // num_kv_heads} heads per KV head"
    if reason is not None:
        if backend == "native":
            raise ValueError(f"attention backend native: {reason}")
        log.info("attention: torch (native kernels unusable: %s)", reason)
        return None
    log.info("attention: native paged kernels (prefill and decode)")
    return PagedAttention(lib, kv_cache, num_heads)


def _unusable(kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> str | None:
    if kv_cache.device.type != "cpu":
        return f"runs on CPU only, the cache is on {kv_cache.device}"
    if kv_cache.dtype not in KERNEL_DTYPES:
        return f"reads bfloat16 or float32, the cache is {kv_cache.dtype}"
    if not kv_cache.is_contiguous() or num_heads % num_kv_heads:
        return "needs a contiguous cache and whole query-head groups"
    return None
