"""Fake probe answers for the status tests, built from the real metric registries.

`/metrics` text is rendered by the server's and router's own `ServerMetrics`/`RouterMetrics`
(with a fake engine), so the view is tested against the names and format they really export.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prometheus_client.exposition import generate_latest

from disagg.protocol import TTFTBreakdown
from disagg.router.metrics import RouterMetrics
from disagg.server.metrics import ServerMetrics
from disagg.status.answer import Answer

__all__ = [
    "FixedLoadEngine",
    "down",
    "instance_answers",
    "json_answer",
    "make_load",
    "render_router_metrics",
    "render_server_metrics",
    "router_answers",
]


class FixedLoadEngine:
    """What ServerMetrics reads of an engine: load() and kv_info(), fixed."""

    def __init__(self, load: Mapping[str, int], kv_info: Mapping[str, Any]) -> None:
        self._load = dict(load)
        self._kv_info = dict(kv_info)

    def load(self) -> dict[str, int]:
        return dict(self._load)

    def kv_info(self) -> dict[str, Any]:
        return dict(self._kv_info)


def make_load(
    *, running: int = 0, waiting: int = 0, free: int = 64, total: int = 64
) -> dict[str, int]:
    """An engine's load() answer."""
    return {
        "num_running": running,
        "num_waiting": waiting,
        "num_free_blocks": free,
        "num_total_blocks": total,
        "num_queued_prefill_tokens": 0,
    }


def render_server_metrics(
    engine: FixedLoadEngine, breakdowns: list[TTFTBreakdown], finish_reasons: list[str]
) -> str:
    """An instance's /metrics after it finished one request per breakdown (arrival at 0 s,
    first token at 0.5 s, finish at 1.5 s, 11 output tokens)."""
    metrics = ServerMetrics(engine)  # type: ignore[arg-type]  # only load/kv_info are read
    for breakdown, reason in zip(breakdowns, finish_reasons, strict=True):
        metrics.observe_finished(
            finish_reason=reason, num_prompt_tokens=40, num_output_tokens=11, arrival_s=0.0,
            first_token_s=0.5, finish_s=1.5, breakdown=breakdown,
        )  # fmt: skip
    return metrics.render().decode()


def render_router_metrics(statuses: list[str], num_recomputed: int = 0) -> str:
    metrics = RouterMetrics()
    for status in statuses:
        metrics.requests.labels(mode="pull", status=status).inc()
    metrics.recomputed.inc(num_recomputed)
    metrics.leg_seconds.labels(leg="prefill").observe(0.1)
    metrics.first_byte_seconds.labels(mode="pull").observe(0.2)
    return generate_latest(metrics.registry).decode()


def json_answer(body: Any, status: int = 200) -> Answer:
    error = None if status == 200 else f"HTTP {status}"
    return Answer(status, json.dumps(body).encode(), error)


def down(reason: str = "[Errno 111] Connection refused") -> Answer:
    return Answer(None, error=reason)


def instance_answers(
    engine: FixedLoadEngine, breakdowns: list[TTFTBreakdown], finish_reasons: list[str]
) -> dict[str, Answer]:
    """A healthy instance's four answers, consistent with each other."""
    text = render_server_metrics(engine, breakdowns, finish_reasons)
    return {
        "/health": json_answer({"status": "ok"}),
        "/load": json_answer(engine.load()),
        "/kv_info": json_answer(engine.kv_info()),
        "/metrics": Answer(200, text.encode()),
    }


def router_answers(instances: list[dict[str, Any]], statuses: list[str]) -> dict[str, Answer]:
    return {
        "/health": json_answer({"status": "ok"}),
        "/instances": json_answer(instances),
        "/metrics": Answer(200, render_router_metrics(statuses, num_recomputed=1).encode()),
    }
