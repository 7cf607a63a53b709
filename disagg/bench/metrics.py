"""Benchmark metrics as pure functions of per-request timestamps (no clock, no I/O).

Owns `RequestResult` (what the client records) and everything derived from it: TTFT, TPOT, ITL,
E2E latency summaries, throughput, goodput under SLOs and the mean TTFT breakdown. Key names
follow what `vllm bench serve` writes so tooling carries over. Must not send requests or print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "LATENCY_METRICS",
    "PER_REQUEST_KEYS",
    "SLO_METRICS",
    "RequestResult",
    "compute_metrics",
    "e2el_s",
    "itls_s",
    "max_concurrency",
    "mean_breakdown",
    "meets_slos",
    "parse_goodput",
    "parse_percentiles",
    "percentile_key",
    "summarize_ms",
    "tpot_s",
    "ttft_s",
]

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
# Lists with one entry per request (failed ones included); large, so kept out of summaries.
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "errors", "breakdowns")
# breakdown entries that are counts, not seconds
_COUNT_KEYS = ("num_descriptors", "num_bytes", "num_prefilled_tokens", "num_reused_tokens")


@dataclass(slots=True)
class RequestResult:
    """What the client recorded for one request; times are perf_counter seconds."""

    input_len: int  # prompt tokens (server usage when reported, else the workload's)
    start_s: float = 0.0  # request sent
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token chunk
    end_s: float = 0.0  # response fully read
    output_len: int = 0  # usage.completion_tokens when reported, else len(token_times_s)
    error: str = ""  # "" = success
    breakdown: dict[str, float] = field(default_factory=dict)  # server's TTFT breakdown
    output_text: str = ""  # the generated text (a conversation's next turn carries it)
    turn: int = 0  # 1-based turn of a multi-turn conversation; 0 = not part of one

    @property
    def success(self) -> bool:
        return not self.error


def ttft_s(r: RequestResult) -> float:
    """Send -> first token chunk, seconds."""
    return r.token_times_s[0] - r.start_s


def itls_s(r: RequestResult) -> list[float]:
    """Gaps between consecutive token chunks, seconds (a chunk may carry several tokens)."""
    t = r.token_times_s
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def e2el_s(r: RequestResult) -> float:
    """Send -> response complete, seconds."""
    return r.end_s - r.start_s


def tpot_s(r: RequestResult) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1), as vLLM defines it; None with < 2 output tokens."""
    if r.output_len < 2:
        return None
    return (e2el_s(r) - ttft_s(r)) / (r.output_len - 1)


def percentile_key(metric: str, p: float) -> str:
    """`p99_ttft_ms`, `p99.9_ttft_ms`: vLLM's naming."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def summarize_ms(metric: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    """mean/median/std (population)/percentiles (linear interpolation) of `values_s`, in ms.

    An empty list summarizes to zeros, as vLLM reports it.
    """
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {
        f"mean_{metric}_ms": float(ms.mean()),
        f"median_{metric}_ms": float(np.median(ms)),
        f"std_{metric}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[percentile_key(metric, p)] = float(np.percentile(ms, p))
    return out


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """True when a successful request meets every SLO (ms); no TPOT counts as meeting it."""
    if not r.success:
        return False
    tpot = tpot_s(r)
    values_s = {"ttft": ttft_s(r), "tpot": 0.0 if tpot is None else tpot, "e2el": e2el_s(r)}
    return all(values_s[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def max_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once (interval overlap of [start, end])."""
    events = sorted(
        [(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results],
        key=lambda e: (e[0], e[1]),  # ends before starts at equal times
    )
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def mean_breakdown(results: list[RequestResult]) -> tuple[dict[str, float], dict[str, float]]:
    """({stage: mean ms}, {count key: mean}) over the successful requests reporting each key.

    Stage names drop the `_s` suffix: `prefill_s` -> `prefill`.
    """
    values: dict[str, list[float]] = {}
    for r in results:
        if r.success:
            for key, value in r.breakdown.items():
                values.setdefault(key, []).append(float(value))
    stages_ms = {
        key.removesuffix("_s"): float(np.mean(v)) * 1000.0
        for key, v in values.items()
        if key not in _COUNT_KEYS
    }
    counts = {key: float(np.mean(v)) for key, v in values.items() if key in _COUNT_KEYS}
    return stages_ms, counts


def _per_request_lists(results: list[RequestResult]) -> dict[str, list[Any]]:
    ok = [r.success for r in results]
    return {
        "input_lens": [r.input_len for r in results],
        "output_lens": [r.output_len if s else 0 for r, s in zip(results, ok, strict=True)],
        "ttfts": [ttft_s(r) if s else 0.0 for r, s in zip(results, ok, strict=True)],
        "itls": [itls_s(r) if s else [] for r, s in zip(results, ok, strict=True)],
        "e2els": [e2el_s(r) if s else 0.0 for r, s in zip(results, ok, strict=True)],
        "errors": [r.error for r in results],
        "breakdowns": [dict(r.breakdown) for r in results],
        **({"turns": [r.turn for r in results]} if any(r.turn for r in results) else {}),
    }


def _latency_summaries(done: list[RequestResult], percentiles: tuple[float, ...]) -> dict:
    tpots = [t for t in (tpot_s(r) for r in done) if t is not None]
    samples = {
        "ttft": [ttft_s(r) for r in done],
        "tpot": tpots,
        "itl": [gap for r in done for gap in itls_s(r)],
        "e2el": [e2el_s(r) for r in done],
    }
    out: dict[str, float] = {}
    for metric in LATENCY_METRICS:
        out.update(summarize_ms(metric, samples[metric], percentiles))
    return out


def turn_summaries(done: list[RequestResult]) -> dict[str, Any]:
    """Multi-turn runs: the median TTFT of each turn (ms, keyed by the 1-based turn) and of
    every turn after the first, where a prefix cache holds the conversation so far."""
    by_turn: dict[int, list[float]] = {}
    for r in done:
        if r.turn:
            by_turn.setdefault(r.turn, []).append(ttft_s(r))
    if not by_turn:
        return {}
    later = [t for turn, ts in by_turn.items() if turn >= 2 for t in ts]
    return {
        "median_ttft_ms_by_turn": {
            str(turn): float(np.median(ts)) * 1000.0 for turn, ts in sorted(by_turn.items())
        },
        "median_ttft_ms_later_turns": float(np.median(later)) * 1000.0 if later else None,
    }


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0),
    slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Every benchmark key for one run; throughputs are per second of `duration_s`.

    Only successful requests count towards tokens, latencies and throughput.
    `request_goodput` is None when no SLO is given (as vLLM writes it).
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in results if r.success]
    total_in = sum(r.input_len for r in done)
    total_out = sum(r.output_len for r in done)
    good = sum(meets_slos(r, slos_ms) for r in done) if slos_ms else None
    stages_ms, counts = mean_breakdown(results)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_concurrent_requests": max_concurrency(results),
    }
    out.update(_latency_summaries(done, percentiles))
    out.update(turn_summaries(done))
    out["mean_breakdown_ms"] = stages_ms
    out["mean_breakdown_counts"] = counts
    out.update(_per_request_lists(results))
    return out


def parse_percentiles(text: str) -> tuple[float, ...]:
    """ "90,99" -> (90.0, 99.0); each in (0, 100]."""
    values = tuple(float(x) for x in text.split(",") if x.strip())
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"percentiles must be comma-separated numbers in (0, 100], got {text!r}")
    return values


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"goodput SLO must be one of {list(SLO_METRICS)} as NAME:MS, got {spec!r}"
            )
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of ms") from exc
        if slos[name] < 0:
            raise ValueError(f"goodput SLO {spec!r} must be >= 0 ms")
    return slos
