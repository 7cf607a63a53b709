"""Which machine a benchmark ran on, in words for a figure: the CPU model and any NVIDIA GPUs.

Read from the OS when the benchmark runs (/proc/cpuinfo, the NVIDIA driver's /proc entries),
so that a result carries it and a figure re-rendered elsewhere still names the right machine.
Never imports torch: the bench must not.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["cpu_info", "describe_host"]

# The flags a CPU figure is shown with: which bf16 / matrix paths the kernels could take.
FLAGS_SHOWN = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_info(proc: Path = Path("/proc")) -> dict[str, Any]:
    """The CPU as /proc/cpuinfo names it (first processor), its flags (and the few that
    matter here, apart), the cores this process may use, and the load when asked."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in (proc / "cpuinfo").read_text(errors="replace").splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    flags = fields.get("flags", "").split()
    return {"model": fields.get("model name", _cpu_model(proc)),
            "cpus": len(os.sched_getaffinity(0)),
            "flags_shown": [f for f in FLAGS_SHOWN if f in flags], "flags": flags,
            "loadavg_1m_start": os.getloadavg()[0]}  # fmt: skip


def describe_host(proc: Path = Path("/proc")) -> str:
    """`CPU AMD EPYC 7R13 Processor, GPU 8 x NVIDIA H200` (the GPU part only where the NVIDIA
    driver is loaded)."""
    text = f"CPU {_cpu_model(proc)}"
    gpus = Counter(_gpu_models(proc))
    if gpus:
        text += ", GPU " + ", ".join(
            name if count == 1 else f"{count} x {name}" for name, count in sorted(gpus.items())
        )
    return text


def _cpu_model(proc: Path) -> str:
    """/proc/cpuinfo's `model name` (x86 Linux), else what platform knows (often only the ISA)."""
    try:
        for line in (proc / "cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine() or "unknown"


def _gpu_models(proc: Path) -> list[str]:
    """One `Model:` per GPU the NVIDIA driver lists (none without the driver)."""
    models = []
    for info in sorted((proc / "driver" / "nvidia" / "gpus").glob("*/information")):
        try:
            lines = info.read_text(errors="replace").splitlines()
        except OSError:
            continue
        models += [line.partition(":")[2].strip() for line in lines if line.startswith("Model:")]
    return models
