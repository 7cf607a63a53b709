"""Small factories for simulator tests: a short workload on a small pool, fast to simulate."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from disagg.bench.workload import WorkloadConfig
from disagg.sim.cluster import SimCluster, run_simulation
from disagg.sim.sim_config import SimConfig


def make_config(
    mode: str = "pull",
    *,
    num_prompts: int = 12,
    input_len: int = 512,
    output_len: int = 16,
    request_rate: float = 4.0,
    **overrides: Any,
) -> SimConfig:
    workload = WorkloadConfig(
        num_prompts=num_prompts, input_len=input_len, output_len=output_len, seed=1
    )
    base = SimConfig(
        mode=mode,  # type: ignore[arg-type]
        model="Qwen3-8B",
        num_blocks=2048,
        workload=workload,
        request_rate=request_rate,
    )
    return replace(base, **overrides)


def simulate(config: SimConfig) -> tuple[dict[str, Any], SimCluster]:
    """run_simulation already checks that every request finished and every pool is full."""
    return run_simulation(config)
