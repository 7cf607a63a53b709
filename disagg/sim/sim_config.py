"""`SimConfig`: one simulated deployment and the traffic sent to it. Frozen and validated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from disagg.bench.workload import WorkloadConfig, length_bounds
from disagg.sim.cost import DescriptorLayout

__all__ = ["SimConfig", "SimMode"]

# pull: the READ set up off the decode loop (our default); pull-inline: on it (vLLM's pull)
SimMode = Literal["pull", "pull-inline", "push", "aggregated"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    mode: SimMode = "pull"
    num_prefill: int = 1  # prefill instances (aggregated: instances = num_prefill + num_decode)
    num_decode: int = 1
    model: str = "Qwen3-32B"  # built-in name, config.json or a model directory
    hardware: str = "h200-p5en"  # profile name in disagg/sim/hardware/ or a TOML path
    tp: int = 1  # GPUs per instance (tensor parallelism)
    layout: DescriptorLayout = "vllm"  # descriptors per transfer: vllm's or ours
    policy: str = "least_loaded"  # router policy for both roles
    kv_aware_request_tokens: int = 16  # the router's --kv-aware-request-tokens
    local_prefill_tokens: int = 0  # the router's --local-prefill-tokens (P/D under kv_aware)
    block_size: int = 16
    num_blocks: int | None = None  # KV blocks per instance; None = what GPU memory holds
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None = the longest request of the workload
    enable_prefix_caching: bool = True
    workload: WorkloadConfig = WorkloadConfig()
    request_rate: float = math.inf  # req/s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    percentiles: tuple[float, ...] = (90.0, 99.0)
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("pull", "pull-inline", "push", "aggregated"):
            raise ValueError(
                f"mode must be pull, pull-inline, push or aggregated, got {self.mode!r}"
            )
        if self.num_prefill <= 0 or self.num_decode < 0:
            raise ValueError(f"need >= 1 prefill and >= 0 decode instances, got {self}")
        if self.mode != "aggregated" and self.num_decode == 0:
            raise ValueError(f"mode {self.mode} needs at least one decode instance")
        if self.tp <= 0:
            raise ValueError(f"tp must be > 0, got {self.tp}")
        if self.kv_aware_request_tokens < 0 or self.local_prefill_tokens < 0:
            raise ValueError("kv_aware_request_tokens and local_prefill_tokens must be >= 0")

    @property
    def is_pull(self) -> bool:
        return self.mode in ("pull", "pull-inline")

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def num_gpus(self) -> int:
        return self.num_instances * self.tp

    @property
    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        w = self.workload
        longest_out = length_bounds(w.output_len, w.range_ratio)[1]
        if w.dataset == "multiturn":  # the last turn holds every user turn and answer before it
            return w.prefix_len + w.num_turns * (w.input_len + longest_out) + 1
        prefix = w.prefix_len if w.dataset == "prefix" else 0
        longest_in = length_bounds(w.input_len, w.range_ratio)[1] + prefix
        return longest_in + longest_out + 1
