"""One snapshot of a cluster (records.py) built from the probes' answers. Pure.

Owns what each endpoint's fields mean to the view: `/instances` (the router's list), each
instance's `/health`, `/load`, `/kv_info` (the connector's counters) and `/metrics` (request
outcomes and the TTFT breakdown histograms). Must not do I/O (probe.py) nor draw (screen.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from disagg.protocol import TTFTBreakdown
from disagg.status.answer import Answer
from disagg.status.prom_text import Samples, parse_samples
from disagg.status.records import ClusterStatus, Health, InstanceStatus, RouterRow, RouterStatus

__all__ = [
    "INSTANCE_PATHS",
    "METRIC_NAMES",
    "ROUTER_PATHS",
    "STAGES",
    "build_cluster",
    "build_instance",
    "build_router",
    "parse_instance_list",
]

# All open endpoints (no API key, no cluster signature): the view needs no credentials.
ROUTER_PATHS = ("/health", "/instances", "/metrics")
INSTANCE_PATHS = ("/health", "/load", "/kv_info", "/metrics")
# The TTFT stages an instance's /metrics has a histogram series for, in critical-path order
# (the server observes every `*_s` field of the breakdown but loop_blocked_s).
STAGES = tuple(
    f.name.removesuffix("_s")
    for f in fields(TTFTBreakdown)
    if f.name.endswith("_s") and f.name != "loop_blocked_s"
)
# Sample names this view reads (server/metrics.py, router/metrics.py); a test holds them true.
_REQUESTS = "disagg_requests_total"  # label finish_reason
_TTFT = "disagg_ttft_seconds"
_STAGE = "disagg_ttft_stage_seconds"  # label stage
_LOOP_BLOCKED = "disagg_kv_loop_blocked_seconds"
_PREFILLED = "disagg_prefilled_tokens_total"
_CACHED = "disagg_prompt_cached_tokens_total"
_REUSED = "disagg_kv_reused_tokens_total"
_ROUTER_REQUESTS = "disagg_router_requests_total"  # labels mode, status
_ROUTER_RECOMPUTED = "disagg_router_recomputed_total"
METRIC_NAMES = (
    _REQUESTS,
    *(f"{h}_{suffix}" for h in (_TTFT, _STAGE, _LOOP_BLOCKED) for suffix in ("sum", "count")),
    _PREFILLED,
    _CACHED,
    _REUSED,
    _ROUTER_REQUESTS,
    _ROUTER_RECOMPUTED,
)

# ---- the router --------------------------------------------------------------------------------


def parse_instance_list(answer: Answer) -> list[RouterRow]:
    """The router's `GET /instances`; ValueError naming what is wrong with it."""
    if not answer.is_ok:
        raise ValueError(f"GET /instances: {answer.error}")
    raw = answer.json()
    if not isinstance(raw, list):
        raise ValueError(f"GET /instances: expected a list, got {type(raw).__name__}")
    rows = []
    for item in raw:
        if not (isinstance(item, dict) and isinstance(item.get("url"), str)):
            raise ValueError(f"GET /instances: entry without a url: {item!r}")
        role = item.get("role")
        is_draining = item.get("draining") is True
        rows.append(RouterRow(item["url"], str(role), item.get("healthy") is True, is_draining))
    return rows


def build_router(url: str, answers: Mapping[str, Answer]) -> RouterStatus:
    """`answers`: path -> Answer for ROUTER_PATHS."""
    health = _health(answers["/health"])
    problems = []
    if health == "down":
        return RouterStatus(url=url, health=health, problems=[f"{answers['/health'].error}"])
    try:
        parse_instance_list(answers["/instances"])
    except ValueError as exc:
        problems.append(str(exc))
    samples, problem = _samples(answers["/metrics"])
    problems += [problem] if problem else []
    by_status = samples.by_label(_ROUTER_REQUESTS, "status")
    return RouterStatus(
        url=url,
        health=health,
        problems=problems,
        num_requests=_int(sum(by_status.values())) if samples.rows else None,
        num_ok=_int(by_status.get("200", 0.0)) if samples.rows else None,
        num_recomputed=_int(samples.total(_ROUTER_RECOMPUTED)),
    )


# ---- one instance ------------------------------------------------------------------------------


def build_instance(row: RouterRow, answers: Mapping[str, Answer]) -> InstanceStatus:
    """`answers`: path -> Answer for INSTANCE_PATHS. A failed probe leaves its fields None."""
    health = _health(answers["/health"])
    if health == "ok" and row.is_draining:
        health = "draining"  # up and finishing its requests; the router sends it nothing new
    base = {"url": row.url, "role": row.role, "health": health, "is_routed": row.is_routed}
    if health == "down":
        return InstanceStatus(**base, problems=[f"{answers['/health'].error}"])
    problems: list[str] = []
    load = _json_object(answers["/load"], "/load", problems)
    kv_info = _json_object(answers["/kv_info"], "/kv_info", problems)
    samples, problem = _samples(answers["/metrics"])
    problems += [problem] if problem else []
    reported_role = kv_info.get("role")
    if isinstance(reported_role, str) and reported_role != row.role:
        problems.append(f"the router lists it as {row.role}, it reports {reported_role}")
    return InstanceStatus(
        **base,
        problems=problems,
        connector=_str(kv_info.get("connector")),
        transport=_str(kv_info.get("transport")),
        **_load_fields(load),
        **_kv_fields(kv_info),
        **_metric_fields(samples),
    )


def _load_fields(load: Mapping[str, Any]) -> dict[str, Any]:
    total, free = _int(load.get("num_total_blocks")), _int(load.get("num_free_blocks"))
    return {
        "num_running": _int(load.get("num_running")),
        "num_waiting": _int(load.get("num_waiting")),
        "num_blocks_used": None if total is None or free is None else total - free,
        "num_blocks_total": total,
    }


def _kv_fields(kv_info: Mapping[str, Any]) -> dict[str, Any]:
    """The connector's cumulative counters; an aggregated instance (no connector) has none."""
    stats = kv_info.get("stats")
    if not isinstance(stats, dict):
        return {}
    expired = [_int(stats.get(k)) for k in ("expired_leases", "expired_reservations")]
    return {
        "num_handoffs": _int(stats.get("transfers")),
        "num_kv_failures": _int(stats.get("transfers_failed")),
        "num_expired": sum(n for n in expired if n is not None),
        "num_kv_bytes": _int(stats.get("bytes")),
    }


def _metric_fields(samples: Samples) -> dict[str, Any]:
    if not samples.rows:
        return {}
    means = {stage: samples.mean(_STAGE, stage=stage) for stage in STAGES}
    loop_count = samples.total(f"{_LOOP_BLOCKED}_count")
    finished = samples.by_label(_REQUESTS, "finish_reason")
    return {
        "num_finished": _int(sum(finished.values())),
        "num_errors": _int(finished.get("error", 0.0)),
        "ttft_mean_s": samples.mean(_TTFT),
        "stage_means_s": {stage: mean for stage, mean in means.items() if mean is not None},
        "loop_blocked_s": samples.total(f"{_LOOP_BLOCKED}_sum") if loop_count else None,
        "loop_blocked_mean_s": samples.mean(_LOOP_BLOCKED),
        "num_prefilled_tokens": _int(samples.total(_PREFILLED)),
        "num_cached_tokens": _int(samples.total(_CACHED)),
        "num_reused_tokens": _int(samples.total(_REUSED)),
    }


# ---- the whole cluster -------------------------------------------------------------------------


def build_cluster(
    router_url: str,
    router_answers: Mapping[str, Answer],
    instances: Sequence[tuple[RouterRow, Mapping[str, Answer]]],
    *,
    taken_at_s: float,
) -> ClusterStatus:
    return ClusterStatus(
        router=build_router(router_url, router_answers),
        instances=[build_instance(row, answers) for row, answers in instances],
        taken_at_s=taken_at_s,
    )


# ---- helpers on plain values -------------------------------------------------------------------


def _health(answer: Answer) -> Health:
    if answer.status is None:
        return "down"
    return "ok" if answer.status == 200 else "unhealthy"


def _json_object(answer: Answer, path: str, problems: list[str]) -> dict[str, Any]:
    """The answer's JSON object, or {} with the reason appended to `problems`."""
    if not answer.is_ok:
        problems.append(f"GET {path}: {answer.error}")
        return {}
    try:
        raw = answer.json()
    except ValueError:
        raw = None
    if not isinstance(raw, dict):
        problems.append(f"GET {path}: not a JSON object")
        return {}
    return raw


def _samples(answer: Answer) -> tuple[Samples, str | None]:
    """Parsed /metrics, or no samples and the reason."""
    if not answer.is_ok:
        return Samples(), f"GET /metrics: {answer.error}"
    try:
        return parse_samples(answer.text()), None
    except ValueError as exc:
        return Samples(), f"GET /metrics: not Prometheus text ({exc})"


def _int(value: Any) -> int | None:
    """A count from JSON or a sample (floats in Prometheus); None if it is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
