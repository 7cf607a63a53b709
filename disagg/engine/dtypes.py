"""Which dtype an engine computes in: `auto` picks bf16 where the device runs it fast.

A CPU without bf16 instructions emulates bf16 matmuls slower than fp32, so `auto` there stays in
fp32; a CPU with AVX512-BF16 or AMX runs a 16-row bf16 GEMM 2-3x faster than fp32 (measured on
the development machine, AVX512-BF16 without AMX). Decided at run time from the CPU's flags,
never assumed from the machine kind.
"""

from __future__ import annotations

import torch

__all__ = ["TORCH_DTYPES", "cpu_flags", "cpu_has_fast_bf16", "resolve_dtype"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16) or AMX-BF16 tiles."""
    try:
        caps = torch.cpu.get_capabilities()  # torch's own cpuinfo probe
    except (AttributeError, RuntimeError):
        return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (`flags` on x86, `Features` on Arm);
    empty where there is no such file."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(requested: str, device: str, checkpoint_dtype: str = "float32") -> str:
    """The dtype name to compute in. `auto`: on CUDA the checkpoint's half dtype (bf16 for an
    fp32 checkpoint, fp16 on GPUs without bf16); on CPU bf16 when the CPU has bf16
    instructions, else fp32. Any other value is returned as asked."""
    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        if not torch.cuda.is_bf16_supported():
            return "float16"
        return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"
