"""The router's own Prometheus metrics (the instances export theirs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["RouterMetrics"]


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()  # one per app: tests run several routers at once
        self.requests = Counter(
            "disagg_router_requests",
            "Client requests by mode and final status (499 = client went away).",
            ["mode", "status"],
            registry=self.registry,
        )
        self.leg_seconds = Histogram(
            "disagg_router_leg_seconds",
            "Duration of one leg: sent -> last byte read from the instance.",
            ["leg"],
            registry=self.registry,
        )
        self.recomputed = Counter(
            "disagg_router_recomputed",
            "Requests whose prefill leg failed and were prefilled on a decode instance.",
            registry=self.registry,
        )
        self.first_byte_seconds = Histogram(
            "disagg_router_time_to_first_byte_seconds",
            "Client request arrival -> first response byte written (router-side TTFT).",
            ["mode"],
            registry=self.registry,
        )
