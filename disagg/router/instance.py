"""The router's live record of one instance (`Instance`), and the base URL that names it.

Plain data: InstancePool (instances.py) is the only writer. Must not do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import yarl

from disagg.router.breaker import CircuitBreaker
from disagg.router.identity import Identity, VLLMIdentity
from disagg.router.policy import InstanceRole, InstanceView, Load

__all__ = ["Instance", "Source", "normalize_url"]

Source = Literal["static", "registered"]  # named on the command line, or registered itself


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`; ValueError if it is no base URL."""
    url = url.strip().rstrip("/")
    url = url if "://" in url else f"http://{url}"
    try:
        parsed = yarl.URL(url)
        is_ok = parsed.scheme in ("http", "https") and bool(parsed.host)
        is_ok = is_ok and not any(c.isspace() for c in url)
    except (ValueError, TypeError):
        is_ok = False
    if not is_ok:
        raise ValueError(f"instance URL must look like http://host:port, got {url!r}")
    return url


@dataclass(slots=True)
class Instance:
    """The router's live record of one instance. Mutated only by InstancePool."""

    url: str  # base URL, no trailing slash
    role: InstanceRole
    breaker: CircuitBreaker
    is_healthy: bool = False
    load: Load | None = None  # last /load answer; None until one arrives or after a failure
    num_pending: int = 0  # requests routed here since `load` was taken
    identity: Identity | None = None  # cached; dropped when the instance goes unhealthy
    problem: str | None = None  # why it takes no work though it answers /health (identify.py)
    source: Source = "static"
    is_draining: bool = False  # finishing what it has; no new work goes to it
    last_heartbeat_s: float | None = None  # monotonic; registered instances only

    @property
    def is_vllm(self) -> bool:
        """Identified as a vLLM instance (its legs, load and aborts are vLLM's)."""
        return isinstance(self.identity, VLLMIdentity)

    @property
    def takes_work(self) -> bool:
        return self.is_healthy and not self.is_draining

    def is_pickable(self, now_s: float) -> bool:
        """Healthy, not draining, and its breaker lets a leg through."""
        return self.takes_work and self.breaker.allows(now_s)

    def view(self, now_s: float) -> InstanceView:
        return InstanceView(
            url=self.url,
            role=self.role,
            is_healthy=self.is_pickable(now_s),  # never a draining one, nor an open breaker
            load=self.load,
            num_pending=self.num_pending,
        )

    def to_dict(self, now_s: float) -> dict[str, Any]:
        age = None if self.last_heartbeat_s is None else round(now_s - self.last_heartbeat_s, 3)
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.is_healthy,
            "draining": self.is_draining,
            "breaker": self.breaker.state.value,
            "source": self.source,
            "heartbeat_age_s": age,
            "engine_id": self.identity.engine_id if self.identity else None,
            "engine": self.identity.engine if self.identity else None,
            "problem": self.problem,
        }
