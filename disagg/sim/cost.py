"""The cost model: how long a model step, a KV transfer and a transfer's setup take.

A step is a roofline over its whole batch: the FLOPs of every scheduled token (2 x params,
plus attention over its context) against peak x MFU, and the bytes it must read (weights once,
plus the KV of every context) against HBM bandwidth x efficiency; plus a fixed CPU overhead and,
with tensor parallelism, two all-reduces per layer. A measured CPU profile (one with a
`[fitted_step]` section) prices the step as the sum form of `fitted_step.py` instead.
Pure arithmetic on plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from disagg.sim.fitted_step import step_features
from disagg.sim.hardware import HardwareProfile
from disagg.sim.model_shape import ModelShape

__all__ = ["CostModel", "DescriptorLayout", "StepShape", "count_runs"]

# ours: one descriptor per block (a block of all layers is contiguous), runs merged.
# vllm: one per (layer, K/V, block), as vLLM's NIXL connector registers its KV.
DescriptorLayout = Literal["ours", "vllm"]


@dataclass(frozen=True, slots=True)
class StepShape:
    """One request's share of a step."""

    num_tokens: int  # tokens computed this step (a prefill chunk, or 1 for a decode)
    context_len: int  # tokens already in its KV cache
    do_sample: bool  # the chunk ends the sequence: the LM head runs for it


@dataclass(frozen=True, slots=True)
class CostModel:
    shape: ModelShape
    hardware: HardwareProfile
    tp: int = 1
    layout: DescriptorLayout = "ours"

    def __post_init__(self) -> None:
        if self.tp <= 0:
            raise ValueError(f"tp must be > 0, got {self.tp}")
        if self.layout not in ("ours", "vllm"):
            raise ValueError(f"layout must be ours or vllm, got {self.layout!r}")
        if self.hardware.fitted_step is not None and self.tp != 1:
            raise ValueError(f"{self.hardware.name} is a measured single-process profile: tp=1")

    # ------------------------------------------------------------------ model step

    def step_s(self, batch: list[StepShape]) -> float:
        """Wall time of one engine step over `batch` (0 for an empty batch)."""
        if not batch:
            return 0.0
        if self.hardware.fitted_step is not None:
            return self._fitted_step_s(batch)
        compute_s = self.step_flops(batch) / (
            self.tp * self.hardware.peak_flops * self.hardware.mfu
        )
        hw = self.hardware
        memory_s = self.step_bytes(batch) / (hw.memory_bandwidth * hw.memory_efficiency)
        return max(compute_s, memory_s) + self._allreduce_s(batch) + hw.step_overhead_s

    def _fitted_step_s(self, batch: list[StepShape]) -> float:
        """The CPU sum form: a core does its GEMMs, attention and KV gather one after another."""
        hw = self.hardware
        assert hw.fitted_step is not None and self.tp == 1, "fitted (CPU) profiles are tp=1"
        items = [(i.num_tokens, i.context_len, i.do_sample) for i in batch]
        variable_s = hw.fitted_step.variable_s(step_features(self.shape, items))
        weights_s = self.shape.weight_bytes(1) / hw.memory_bandwidth
        return hw.step_overhead_s + weights_s + variable_s

    def step_flops(self, batch: list[StepShape]) -> float:
        """FLOPs of the whole step, all ranks together."""
        s = self.shape
        num_tokens = sum(item.num_tokens for item in batch)
        num_sampled = sum(1 for item in batch if item.do_sample)
        flops = 2.0 * (s.num_body_params * num_tokens + s.num_lm_head_params * num_sampled)
        return flops + sum(s.attention_flops(i.num_tokens, i.context_len) for i in batch)

    def step_bytes(self, batch: list[StepShape]) -> float:
        """Bytes one rank reads and writes: its weights once, each request's KV context read,
        the new tokens' KV written."""
        kv_per_token = self.shape.kv_bytes_per_token(self.tp)
        kv_tokens = sum(item.context_len + item.num_tokens for item in batch)
        return self.shape.weight_bytes(self.tp) + kv_tokens * kv_per_token

    def _allreduce_s(self, batch: list[StepShape]) -> float:
        """Two ring all-reduces of the hidden state per layer (after attention and MLP)."""
        if self.tp == 1:
            return 0.0
        s, hw = self.shape, self.hardware
        num_tokens = sum(item.num_tokens for item in batch)
        size = num_tokens * s.hidden_size * s.dtype_bytes
        moved = 2 * s.num_layers * 2 * size * (self.tp - 1) / self.tp
        return moved / (hw.nvlink_bandwidth * hw.nvlink_efficiency)

    # ------------------------------------------------------------------ KV handoff

    def num_blocks(self, block_size: int) -> int:
        """KV blocks one instance's pool holds: memory left after weights, per rank."""
        hw = self.hardware
        free = hw.memory_bytes * hw.memory_utilization - hw.reserved_bytes
        free -= self.shape.weight_bytes(self.tp)
        if free <= 0:
            raise ValueError(
                f"{self.shape.name} at tp={self.tp} does not fit in {hw.name}'s memory"
            )
        return int(free // (block_size * self.shape.kv_bytes_per_token(self.tp)))

    def kv_bytes(self, num_blocks: int, block_size: int) -> int:
        """Bytes a handoff of `num_blocks` moves, all ranks together."""
        ranks = self.tp
        return num_blocks * block_size * self.shape.kv_bytes_per_token(self.tp) * ranks

    def transfer_s(self, num_bytes: float) -> float:
        """Time on the wire for `num_bytes` between two instances (latency excluded)."""
        return num_bytes / self.hardware.link_bandwidth(self.tp)

    def num_descriptors(self, local_ids: list[int], remote_ids: list[int]) -> int:
        """Descriptors one rank posts for a handoff between these block lists."""
        if self.layout == "vllm":
            return len(local_ids) * self.shape.num_layers * 2
        return count_runs(local_ids, remote_ids)

    def setup_s(self, num_descriptors: int) -> float:
        """Setup of one transfer: fixed cost plus descriptor preparation."""
        hw = self.hardware
        return hw.setup_fixed_s + num_descriptors * hw.setup_per_descriptor_s


def count_runs(local_ids: list[int], remote_ids: list[int]) -> int:
    """Runs of blocks contiguous on both sides: one descriptor each."""
    runs = 0
    for i, (local, remote) in enumerate(zip(local_ids, remote_ids, strict=True)):
        if i == 0 or local != local_ids[i - 1] + 1 or remote != remote_ids[i - 1] + 1:
            runs += 1
    return runs
