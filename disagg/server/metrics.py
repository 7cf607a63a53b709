"""Prometheus metrics of one instance: request outcomes, token counts, latencies, TTFT breakdown,
and engine load read live at scrape time.

Each `ServerMetrics` owns its CollectorRegistry, so several apps can live in one process (tests).
Must not time anything itself: the HTTP handler passes the timestamps it took.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from disagg.protocol import TTFTBreakdown
from disagg.server.engine_client import EngineClient

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds; CPU runs reach tens of seconds, GPU decode steps are milliseconds.
_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# Engine-loop stalls: a dict update is microseconds, an inline READ post of a long prompt tens
# of milliseconds.
_LOOP_BUCKETS_S = (
    1e-5, 3e-5, 1e-4, 3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0,
)  # fmt: skip
_DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
_BYTE_BUCKETS = tuple(float(4**k * 1024) for k in range(12))  # 1 KiB .. 4 GiB
# engine.load() key -> (gauge name, help)
_LOAD_GAUGES = {
    "num_running": ("disagg_num_requests_running", "Requests in the running batch"),
    "num_waiting": ("disagg_num_requests_waiting", "Requests queued (incl. waiting for KV)"),
    "num_free_blocks": ("disagg_kv_blocks_free", "Free KV blocks"),
    "num_total_blocks": ("disagg_kv_blocks_total", "KV blocks in the pool"),
    "num_queued_prefill_tokens": (
        "disagg_queued_prefill_tokens",
        "Prompt tokens not yet prefilled",
    ),
}


class ServerMetrics:
    """The metrics one HTTP app exports at /metrics."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "disagg_requests", "Finished requests", ["finish_reason"], registry=r
        )
        self._prompt_tokens = Counter("disagg_prompt_tokens", "Prompt tokens", registry=r)
        self._generation_tokens = Counter("disagg_generation_tokens", "Output tokens", registry=r)
        self._ttft = _seconds("disagg_ttft_seconds", "Arrival to first output token", r)
        self._tpot = _seconds("disagg_tpot_seconds", "Mean time per output token after first", r)
        self._e2e = _seconds("disagg_e2e_seconds", "Arrival to finish", r)
        self._stage = Histogram(
            "disagg_ttft_stage_seconds",
            "TTFT breakdown: time per critical-path stage (queue, prefill, handoff_setup, ...)",
            ["stage"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self._loop_blocked = Histogram(
            "disagg_kv_loop_blocked_seconds",
            "Engine-loop time spent on one request's KV handoff (every running decode waits)",
            buckets=_LOOP_BUCKETS_S,
            registry=r,
        )
        self._descriptors = Histogram(
            "disagg_kv_descriptors",
            "Descriptors per KV handoff",
            buckets=_DESCRIPTOR_BUCKETS,
            registry=r,
        )
        self._bytes = Histogram(
            "disagg_kv_transfer_bytes", "Bytes per KV handoff", buckets=_BYTE_BUCKETS, registry=r
        )
        self._prefilled = Counter(
            "disagg_prefilled_tokens", "Prompt tokens computed here (not cached)", registry=r
        )
        self._cached = Counter(
            "disagg_prompt_cached_tokens",
            "Prompt tokens of prefills here that this instance's prefix cache covered",
            registry=r,
        )
        self._reused = Counter(
            "disagg_kv_reused_tokens",
            "Decode side: prompt tokens taken from this instance's own cache, not moved",
            registry=r,
        )
        r.register(_LoadCollector(engine))
        r.register(_ConnectorCollector(engine))

    def observe_finished(
        self,
        *,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        arrival_s: float,
        first_token_s: float | None,
        finish_s: float,
        breakdown: TTFTBreakdown | None,
    ) -> None:
        """Record one request; times are from one monotonic clock, in seconds."""
        self._requests.labels(finish_reason=finish_reason).inc()
        self._prompt_tokens.inc(num_prompt_tokens)
        self._generation_tokens.inc(num_output_tokens)
        self._e2e.observe(finish_s - arrival_s)
        if first_token_s is not None:
            self._ttft.observe(first_token_s - arrival_s)
            if num_output_tokens > 1:
                self._tpot.observe((finish_s - first_token_s) / (num_output_tokens - 1))
        if breakdown is not None:
            self._observe_breakdown(breakdown)
            if breakdown.num_prefilled_tokens is not None:
                self._cached.inc(max(0, num_prompt_tokens - breakdown.num_prefilled_tokens))

    def _observe_breakdown(self, breakdown: TTFTBreakdown) -> None:
        for name, value in breakdown.to_dict().items():
            if name.endswith("_s") and name != "loop_blocked_s":
                self._stage.labels(stage=name.removesuffix("_s")).observe(value)
        if breakdown.loop_blocked_s is not None:
            self._loop_blocked.observe(breakdown.loop_blocked_s)
        if breakdown.num_descriptors is not None:
            self._descriptors.observe(breakdown.num_descriptors)
        if breakdown.num_bytes is not None:
            self._bytes.observe(breakdown.num_bytes)
        if breakdown.num_prefilled_tokens is not None:
            self._prefilled.inc(breakdown.num_prefilled_tokens)
        if breakdown.num_reused_tokens is not None:
            self._reused.inc(breakdown.num_reused_tokens)

    def render(self) -> bytes:
        """Prometheus text exposition (reads engine.load() once)."""
        return generate_latest(self.registry)


def _seconds(name: str, help_text: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, help_text, buckets=_LATENCY_BUCKETS_S, registry=registry)


class _LoadCollector(Collector):
    """Gauges read from engine.load() at scrape time, so they are never stale."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        # Declared without samples so registering does not call the engine.
        blocks = [GaugeMetricFamily("disagg_kv_blocks_in_use", "KV blocks allocated")]
        return blocks + [GaugeMetricFamily(name, text) for name, text in _LOAD_GAUGES.values()]

    def collect(self) -> Iterator[Metric]:
        load = self._engine.load()
        in_use = load["num_total_blocks"] - load["num_free_blocks"]
        yield GaugeMetricFamily("disagg_kv_blocks_in_use", "KV blocks allocated", value=in_use)
        for key, (name, text) in _LOAD_GAUGES.items():
            if key in load:
                yield GaugeMetricFamily(name, text, value=load[key])


class _ConnectorCollector(Collector):
    """The KV connector's cumulative statistics (transfers, bytes, descriptors, failures,
    expired leases and reservations, handshakes), read from kv_info() at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []  # the set depends on the connector; nothing to declare up front

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.kv_info().get("stats") or {}
        for key, value in stats.items():
            yield CounterMetricFamily(_counter_name(key), f"KV connector: {key}", value=value)


# `blocks` would render as disagg_kv_blocks_total, the pool-size gauge's name.
_RENAMED_STATS = {"blocks": "transferred_blocks"}


def _counter_name(stat: str) -> str:
    """`transfer_s_total` -> `disagg_kv_transfer_seconds`, `bytes` -> `disagg_kv_bytes`
    (the client library appends `_total`)."""
    base = _RENAMED_STATS.get(stat, stat).removesuffix("_total")
    base = base.removesuffix("_s") + "_seconds" if base.endswith("_s") else base
    return f"disagg_kv_{base}"
