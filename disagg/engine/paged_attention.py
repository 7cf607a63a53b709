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

Built with the system C++ compiler (`$CXX`, default g++) for this CPU (-march=native) into the
disagg cache, keyed by sources, flags, compiler and CPU flags, so a restart or a second instance
loads it (~ms). Without a compiler, or on CUDA, or for fp16, the torch path runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from disagg.config import cache_dir

__all__ = ["PagedAttention", "load_library", "make_paged_attention"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (_CSRC / "paged_decode.cpp", _CSRC / "paged_prefill.cpp")
_HEADERS = (_CSRC / "paged_kv.h",)
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_BUILD_TIMEOUT_S = 120.0
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}  # what the kernel reads -> its is_bf16 flag

_i64 = ctypes.c_int64
_TAIL = [ctypes.c_float, ctypes.c_int, ctypes.c_int]  # scale, is_bf16, num_threads
_DECODE_ARGS = [ctypes.c_void_p] * 5 + [_i64] * 8 + _TAIL
_PREFILL_ARGS = [ctypes.c_void_p] * 4 + [_i64] * 8 + _TAIL


class PagedAttention:
    """The kernels bound to one cache: `decode` for a batch of one-token sequences, `prefill`
    for one sequence's chunk of new tokens (its K/V already written to the cache)."""

    def __init__(self, lib: ctypes.CDLL, kv_cache: torch.Tensor, num_heads: int) -> None:
        self._decode = lib.disagg_paged_decode
        self._prefill = lib.disagg_paged_prefill
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, Hkv, block_size, D], contiguous
        _, self.num_layers, _, self.num_kv_heads, self.block_size, self.head_dim = kv_cache.shape
        self.num_heads = num_heads
        self.is_bf16 = _DTYPES[kv_cache.dtype]
        self.scale = self.head_dim**-0.5

    def decode(
        self, layer: int, q: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """q [B, Hq, D]; table [B, W] long block ids; lens [B] long keys each -> [B, Hq, D]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        status = self._decode(
            q.data_ptr(), self.kv_cache.data_ptr(), out.data_ptr(), table.data_ptr(),
            lens.data_ptr(), q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim,
            self.num_layers, self.block_size, table.shape[1], layer, self.scale, self.is_bf16,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"paged decode kernel refused its shapes (status {status})")
        return out

    def prefill(
        self, layer: int, q: torch.Tensor, blocks: torch.Tensor, start_pos: int
    ) -> torch.Tensor:
        """q [n, Hq, D], the tokens at positions start_pos .. start_pos + n - 1; blocks [nb]
        long, the sequence's blocks covering start_pos + n keys -> [n, Hq, D], causal."""
        q = q.contiguous()
        out = torch.empty_like(q)
        status = self._prefill(
            q.data_ptr(), self.kv_cache.data_ptr(), out.data_ptr(), blocks.data_ptr(),
            q.shape[0], start_pos, self.num_heads, self.num_kv_heads, self.head_dim,
            self.num_layers, self.block_size, layer, self.scale, self.is_bf16,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"paged prefill kernel refused its shapes (status {status})")
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
        reason = "the kernel did not build (see the warning above)"
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
    if kv_cache.dtype not in _DTYPES:
        return f"reads bfloat16 or float32, the cache is {kv_cache.dtype}"
    if not kv_cache.is_contiguous() or num_heads % num_kv_heads:
        return "needs a contiguous cache and whole query-head groups"
    return None


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The built kernel (built now if this machine has none yet), or None when it cannot be
    built here (logged once). Concurrent builders each write their own file and rename it
    into place: the result is the same, and nobody waits on a lock a dead process left."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        log.warning(
            "no C++ compiler %s on PATH: the paged attention kernels are not built", compiler
        )
        return None
    path = _library_path(compiler)
    if not path.exists():
        try:
            _build(compiler, path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("the paged attention kernels did not build: %s", exc)
            return None
    lib = ctypes.CDLL(str(path))
    lib.disagg_paged_decode.argtypes = _DECODE_ARGS
    lib.disagg_paged_decode.restype = ctypes.c_int
    lib.disagg_paged_prefill.argtypes = _PREFILL_ARGS
    lib.disagg_paged_prefill.restype = ctypes.c_int
    lib.disagg_paged_decode_supports.argtypes = [_i64, _i64]
    lib.disagg_paged_decode_supports.restype = ctypes.c_int
    return lib


def _library_path(compiler: str) -> Path:
    """Keyed by everything the binary depends on: a changed source, flag, compiler or CPU
    (a cache dir shared between machines) gets its own build."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    key = hashlib.sha256()
    sources = [path.read_bytes() for path in (*_SOURCES, *_HEADERS)]
    for part in (*sources, " ".join(_FLAGS).encode(), version.encode(), _cpu_flags()):
        key.update(part)
    return cache_dir() / "kernels" / f"paged_attention-{key.hexdigest()[:16]}.so"


def _cpu_flags() -> bytes:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    rows = [row for row in text.splitlines() if row.startswith(("flags", "Features"))]
    return rows[0].encode() if rows else b""


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, *map(str, _SOURCES)],
            capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip()[-2000:] or "compiler failed")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the paged attention kernels in %.1f s", time.perf_counter() - started)
