"""abuse_bench.py's pure statistics: which inter-token gaps of the victim's streams overlap a
window, their p50 / p99 / max, ratios against the baseline window, and the slowest /health.

Plain functions of recorded (monotonic) timestamps: no clock, no I/O.
"""

from __future__ import annotations

from typing import Any


def gaps_overlapping(
    chunk_times: list[tuple[int, float]], start_s: float, end_s: float
) -> list[float]:
    """Gaps (s) between consecutive chunks of the same stream that overlap [start_s, end_s].
    `chunk_times`: (stream index, arrival s) in arrival order; a stream's first chunk opens no
    gap (that is its TTFT), nor does the step from one stream to the next."""
    gaps, last = [], {}
    for stream, arrival_s in chunk_times:
        previous = last.get(stream)
        last[stream] = arrival_s
        if previous is not None and previous < end_s and arrival_s > start_s:
            gaps.append(arrival_s - previous)
    return gaps


def gap_stats(gaps: list[float]) -> dict[str, Any]:
    """{num_gaps, median_ms, p99_ms, max_ms} of gaps in seconds (None when there are none)."""
    median, p99 = percentile(gaps, 50), percentile(gaps, 99)
    maximum = max(gaps, default=None)
    return {"num_gaps": len(gaps), "median_ms": to_ms(median), "p99_ms": to_ms(p99),
            "max_ms": to_ms(maximum)}  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, rounded; None when either is missing or the baseline is 0."""
    if value is None or not baseline:
        return None
    return round(value / baseline, 2)


def slowest_health(
    samples: list[tuple[str, float, float, int]], name: str, start_s: float, end_s: float
) -> dict[str, Any]:
    """The slowest /health of `name` among probes started in [start_s, end_s], and how many
    did not answer 200. `samples`: (name, started s, latency s, status; 0 = no answer)."""
    mine = [(lat, status) for n, t, lat, status in samples if n == name and start_s <= t <= end_s]
    slowest = max((lat for lat, _ in mine), default=None)
    return {"num": len(mine), "max_ms": to_ms(slowest), "failed": sum(s != 200 for _, s in mine)}


def to_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)
