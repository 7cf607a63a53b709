"""Our CPU kernels (csrc/): built at first use with the system C++ compiler for this CPU and
loaded through ctypes, so no torch headers or build step at install (about 8 s of g++ once).

One library holds them all: paged attention (paged_decode.cpp, paged_prefill.cpp; bound in
paged_attention.py) and the fused pointwise ops (fused_ops.cpp; fused_ops.py). `$CXX` picks the
compiler (default g++); -march=native builds for this CPU, so the file in the disagg cache is
keyed by sources, flags, compiler and CPU flags (a cache dir shared between machines gets one
build per kind). Without a compiler `load_library()` is None and every caller runs torch.
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
from disagg.engine.dtypes import cpu_flags

__all__ = ["KERNEL_DTYPES", "SOURCES", "load_library"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(_CSRC / name for name in ("paged_decode.cpp", "paged_prefill.cpp",
                                           "fused_ops.cpp", "paged_kv.h"))  # fmt: skip
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_BUILD_TIMEOUT_S = 120.0
KERNEL_DTYPES = {torch.bfloat16: 1, torch.float32: 0}  # what the kernels read -> is_bf16 flag

_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_TAIL = [_float, _int, _int]  # scale | eps, is_bf16, num_threads
_SIGNATURES = {  # C function -> (argument types, return type)
    "disagg_paged_decode": ([_ptr] * 5 + [_i64] * 8 + _TAIL, _int),
    "disagg_paged_prefill": ([_ptr] * 4 + [_i64] * 8 + _TAIL, _int),
    "disagg_paged_decode_supports": ([_i64, _i64], _int),
    "disagg_add_rms_norm": ([_ptr] * 5 + [_i64] * 2 + _TAIL, None),
    "disagg_silu_mul": ([_ptr] * 2 + [_i64] * 2 + [_int, _int], None),
}


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The built library (built now if this machine has none yet), or None when it cannot be
    built here (logged once). Concurrent builders each write their own file and rename it
    into place: the result is the same, and nobody waits on a lock a dead process left."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler %s on PATH: the CPU kernels are not built", compiler)
        return None
    path = _library_path(compiler)
    if not path.exists():
        try:
            _build(compiler, path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("the CPU kernels did not build: %s", exc)
            return None
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def _library_path(compiler: str) -> Path:
    """Keyed by everything the binary depends on: a changed source, flag, compiler or CPU
    (a cache dir shared between machines) gets its own build."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    key = hashlib.sha256()
    sources = [path.read_bytes() for path in SOURCES]
    flags = " ".join(sorted(cpu_flags())).encode()
    for part in (*sources, " ".join(_FLAGS).encode(), version.encode(), flags):
        key.update(part)
    return cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, *(str(p) for p in SOURCES if p.suffix == ".cpp")],
            capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip()[-2000:] or "compiler failed")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU kernels in %.1f s", time.perf_counter() - started)
