"""The router's own Prometheus metrics (the instances export theirs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.retries = Counter(
            "disagg_router_retries",
            "Legs sent again, to another instance, after they never reached theirs.",
            ["leg"],
            registry=self.registry,
        )
        self.breaker_opened = Counter(
            "disagg_router_breaker_opened",
            "Times an instance's circuit breaker opened (it takes no work until its probe).",
            ["role", "url"],
            registry=self.registry,
        )
        self.admission_refused = Counter(
            "disagg_router_admission_refused",
            "Client requests refused by admission: queue_full (429) or queue_timeout (503).",
            ["reason"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "disagg_router_requests_in_flight",
            "Client requests holding an admission slot.",
            registry=self.registry,
        )
        self.queued = Gauge(
            "disagg_router_requests_queued",
            "Client requests waiting for an admission slot.",
            registry=self.registry,
        )
