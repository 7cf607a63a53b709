"""The records `disagg status` shows: one per instance, one for the router, one per snapshot.

Pure data with the few properties the screen needs; snapshot.py fills them, screen.py draws
them, `ClusterStatus.to_dict()` is the `--json` document.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["ClusterStatus", "Health", "InstanceStatus", "RouterRow", "RouterStatus"]

# /health: 200 | answered otherwise | no answer; draining: 200, and the router says it is leaving
Health = Literal["ok", "draining", "unhealthy", "down"]


@dataclass(frozen=True, slots=True)
class RouterRow:
    """One entry of the router's `GET /instances`."""

    url: str  # base URL, as the router reaches it
    role: str  # prefill | decode | both
    is_routed: bool  # the router's own health view: it sends this instance requests
    is_draining: bool = False  # finishing its requests before it leaves; gets no new work


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceStatus:
    """What the view shows of one instance. None = that probe did not answer."""

    url: str
    role: str  # as the router lists it
    health: Health
    is_routed: bool
    problems: list[str] = field(default_factory=list)  # why a probe failed, for the screen
    connector: str | None = None  # pull | push; None for role both
    transport: str | None = None  # nixl | tcp | local
    num_running: int | None = None
    num_waiting: int | None = None  # queued, including waiting for KV
    num_blocks_used: int | None = None
    num_blocks_total: int | None = None
    num_handoffs: int | None = None  # KV transfers this instance's connector completed
    num_kv_failures: int | None = None  # handoffs that failed (failed or recomputed requests)
    num_expired: int | None = None  # leases + reservations that ran out (a peer never came)
    num_finished: int | None = None  # requests finished, any reason
    num_errors: int | None = None  # requests finished with finish_reason "error"
    ttft_mean_s: float | None = None  # arrival here -> first token here, since start
    stage_means_s: dict[str, float] = field(default_factory=dict)  # STAGES this instance runs
    loop_blocked_s: float | None = None  # engine-loop time spent on KV handoffs, since start
    loop_blocked_mean_s: float | None = None  # the same per handoff
    num_prefilled_tokens: int | None = None  # prompt tokens computed here
    num_cached_tokens: int | None = None  # prompt tokens of prefills here the cache covered
    num_reused_tokens: int | None = None  # decode side: prompt KV taken from its own cache
    num_kv_bytes: int | None = None  # KV bytes this instance's connector moved (in or out)

    @property
    def cache_hit_fraction(self) -> float | None:
        """Of the prompt tokens of the prefills run here, the share the prefix cache covered."""
        if self.num_cached_tokens is None or self.num_prefilled_tokens is None:
            return None
        total = self.num_cached_tokens + self.num_prefilled_tokens
        return self.num_cached_tokens / total if total else None

    @property
    def blocks_used_fraction(self) -> float | None:
        if self.num_blocks_used is None or not self.num_blocks_total:
            return None
        return self.num_blocks_used / self.num_blocks_total


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterStatus:
    url: str
    health: Health  # "unhealthy": up, but some pool has no healthy instance
    problems: list[str] = field(default_factory=list)
    num_requests: int | None = None  # client requests finished, any status
    num_ok: int | None = None  # ... with HTTP 200
    num_recomputed: int | None = None  # prefill failed, prefilled on a decode instance

    @property
    def is_reachable(self) -> bool:
        return self.health != "down"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterStatus:
    router: RouterStatus
    instances: list[InstanceStatus]
    taken_at_s: float  # unix time of the snapshot

    def to_dict(self) -> dict[str, Any]:
        """The `--json` document: every field, None as null."""
        return {
            "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.taken_at_s)),
            "router": asdict(self.router),
            "instances": [asdict(inst) for inst in self.instances],
        }
