"""Hardware profiles: plain TOML files (one per machine type) read into a frozen dataclass.

Owns the figures the cost model needs and where they come from (the TOML files cite them).
A name looks in `disagg/sim/hardware/`; a path reads that file. A profile with a
`[fitted_step]` section (a measured CPU) prices steps with that form instead of the roofline;
one with `[host]` shares its cores among the deployment's processes (host_cpu.py).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from disagg.sim.fitted_step import FittedStep
from disagg.sim.host_cpu import HostCpu

__all__ = ["HardwareProfile", "list_profiles", "load_profile"]

_PROFILE_DIR = Path(__file__).parent / "hardware"


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    name: str
    peak_flops: float  # dense FLOP/s of one GPU at the model's dtype
    memory_bandwidth: float  # bytes/s of one GPU's HBM
    memory_bytes: float  # one GPU's memory
    mfu: float  # fraction of peak_flops a prefill reaches
    memory_efficiency: float  # fraction of memory_bandwidth a decode reaches
    memory_utilization: float  # fraction of memory_bytes the engine may use
    reserved_bytes: float  # per GPU, not weights nor KV (activations, graphs)
    nvlink_bandwidth: float  # bytes/s per GPU for tensor-parallel all-reduce
    nvlink_efficiency: float
    bandwidth_per_gpu: float  # bytes/s of inter-instance network per GPU
    gpus_per_node: int
    efficiency: float  # fraction of network line rate a transfer reaches
    latency_s: float  # one-way network latency of a transfer or notification
    http_hop_s: float  # one HTTP hop through the router
    step_overhead_s: float  # fixed CPU time per engine step
    setup_fixed_s: float  # per transfer setup on the initiating side
    setup_per_descriptor_s: float  # per descriptor of a transfer's setup
    # True where the transport copies inside post() (NIXL over cross-memory attach on one
    # host): a pull's READ then runs on the decode engine loop, not beside it.
    copy_in_post: bool = False
    # Per output token, serving work that shares the engine loop's interpreter (our instance
    # detokenizes and writes SSE in the engine's process); 0 where that runs elsewhere.
    output_token_s: float = 0.0
    fitted_step: FittedStep | None = None  # measured CPU step form; None = the roofline
    # The cores one host's processes share and the serving work around the engine (a measured
    # CPU profile's [host]); None = processes never wait for a core (a GPU host).
    host: HostCpu | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and value < 0:
                raise ValueError(f"hardware {self.name}: {f.name} must be >= 0, got {value}")
        for name in ("mfu", "memory_efficiency", "memory_utilization", "efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name}: {name} must be in (0, 1]")

    def link_bandwidth(self, tp: int) -> float:
        """Effective bytes/s between two instances of `tp` GPUs: each rank moves its own
        share of the KV over its own NIC, at most a whole node's."""
        num_gpus = min(tp, self.gpus_per_node)
        return self.bandwidth_per_gpu * num_gpus * self.efficiency


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """TOML sections -> field names (`[kv_setup] fixed_s` -> `setup_fixed_s`)."""
    flat: dict[str, Any] = {"name": raw.get("name", "")}
    for section, values in raw.items():
        if not isinstance(values, dict):
            continue
        if section == "fitted_step":
            flat["fitted_step"] = FittedStep(**values)
            continue
        if section == "host":
            flat["host"] = HostCpu(**values)
            continue
        prefix = "setup_" if section == "kv_setup" else ""
        flat.update({prefix + key: value for key, value in values.items()})
    return flat


def load_profile(name_or_path: str) -> HardwareProfile:
    path = Path(name_or_path)
    if not path.is_file():
        path = _PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(f"hardware {name_or_path!r}: no such file or profile ({list_profiles()})")
    flat = _flatten(tomllib.loads(path.read_text()))
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(flat) - known)
    optional = {"copy_in_post", "output_token_s", "fitted_step", "host"}
    missing = sorted(known - set(flat) - optional)
    if unknown or missing:
        raise ValueError(f"hardware {path.name}: unknown keys {unknown}, missing keys {missing}")
    return HardwareProfile(**flat)


def list_profiles() -> list[str]:
    return sorted(p.stem for p in _PROFILE_DIR.glob("*.toml"))
