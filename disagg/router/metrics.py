"""The router's own Prometheus metrics (the instances export theirs), declared in one table.

Each RouterMetrics registers every metric in its own registry: tests run several routers at once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RouterMetrics"]

# attribute -> (kind, metric name, label names, help)
_METRICS: dict[str, tuple[type[Counter | Gauge | Histogram], str, tuple[str, ...], str]] = {
    "requests": (Counter, "disagg_router_requests", ("mode", "status"),
                 "Client requests by mode and final status (499 = client went away)."),
    "leg_seconds": (Histogram, "disagg_router_leg_seconds", ("leg",),
                    "Duration of one leg: sent -> last byte read from the instance."),
    "recomputed": (Counter, "disagg_router_recomputed", (),
                   "Requests whose prefill leg failed and were prefilled on a decode instance."),
    "first_byte_seconds": (Histogram, "disagg_router_time_to_first_byte_seconds", ("mode",),
                           "Client request arrival -> first response byte written (router-side "
                           "TTFT)."),
    "retries": (Counter, "disagg_router_retries", ("leg",),
                "Legs sent again, to another instance, after they never reached theirs."),
    "breaker_opened": (Counter, "disagg_router_breaker_opened", ("role", "url"),
                       "Times an instance's circuit breaker opened (it takes no work until its "
                       "probe)."),
    "admission_refused": (Counter, "disagg_router_admission_refused", ("reason",),
                          "Client requests refused by admission: queue_full (429) or "
                          "queue_timeout (503)."),
    "prefill_placement": (Counter, "disagg_router_prefill_placement", ("where",),
                          "P/D requests by where their prompt was computed: remote_prefill (a "
                          "prefill instance) or local_prefill (the decode instance that caches "
                          "most of it; --local-prefill-tokens)."),
    "in_flight": (Gauge, "disagg_router_requests_in_flight", (),
                  "Client requests holding an admission slot."),
    "queued": (Gauge, "disagg_router_requests_queued", (),
               "Client requests waiting for an admission slot."),
}  # fmt: skip


class RouterMetrics:
    # One attribute per row of _METRICS, typed for the code that updates them.
    requests: Counter
    leg_seconds: Histogram
    recomputed: Counter
    first_byte_seconds: Histogram
    retries: Counter
    breaker_opened: Counter
    admission_refused: Counter
    prefill_placement: Counter
    in_flight: Gauge
    queued: Gauge

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for attribute, (kind, name, labels, text) in _METRICS.items():
            setattr(self, attribute, kind(name, text, labels, registry=self.registry))
