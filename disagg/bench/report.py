"""Rendering of benchmark results: the stdout table, JSON documents, markdown and PNG plots.

Owns presentation only: every function takes result dicts (as `run_benchmark` returns them, or
the runs of a sweep) and writes text or files. Computes no statistics beyond picking values, sends
no requests. matplotlib is imported lazily with the Agg backend, so no display is ever needed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from disagg.bench.metrics import PER_REQUEST_KEYS, percentile_key

__all__ = [
    "BREAKDOWN_STAGES",
    "breakdown_at_highest_load",
    "format_sweep_markdown",
    "format_table",
    "plot_run",
    "plot_sweep",
    "summary",
    "to_json_line",
    "write_json",
]

# TTFT critical-path stages in path order (TTFTBreakdown fields without `_s`).
BREAKDOWN_STAGES = ("queue", "prefill", "handoff_setup", "transfer", "decode_wait", "first_step")
_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
_WIDTH = 50


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The result without its per-request lists."""
    return {k: v for k, v in result.items() if k not in PER_REQUEST_KEYS}


def to_json_line(result: dict[str, Any]) -> str:
    """One line of JSON: the summary printed as the last stdout line."""
    return json.dumps(summary(result), separators=(",", ":"), default=str)


def write_json(doc: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def _row(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:<10}"


def _section(title: str) -> str:
    return f" {title} ".center(_WIDTH, "-")


def _latency_rows(result: dict[str, Any], metric: str, percentiles: tuple[float, ...]) -> list:
    title, short = _TITLES[metric]
    rows = [_section(title)]
    rows.append(_row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"]))
    rows.append(_row(f"Median {short} (ms):", result[f"median_{metric}_ms"]))
    for p in percentiles:
        word = percentile_key(metric, p).split("_")[0].upper()
        rows.append(_row(f"{word} {short} (ms):", result[percentile_key(metric, p)]))
    return rows


def format_table(result: dict[str, Any], percentiles: tuple[float, ...]) -> str:
    """A `vllm bench serve`-style table of one run."""
    rows = [" Serving Benchmark Result ".center(_WIDTH, "=")]
    rows.append(_row("Successful requests:", result["completed"]))
    rows.append(_row("Failed requests:", result["failed"]))
    rows.append(_row("Peak concurrent requests:", result["max_concurrent_requests"]))
    rows.append(_row("Benchmark duration (s):", result["duration"]))
    rows.append(_row("Total input tokens:", result["total_input_tokens"]))
    rows.append(_row("Total generated tokens:", result["total_output_tokens"]))
    rows.append(_row("Request throughput (req/s):", result["request_throughput"]))
    if result.get("request_goodput") is not None:
        rows.append(_row("Request goodput (req/s):", result["request_goodput"]))
    rows.append(_row("Output token throughput (tok/s):", result["output_throughput"]))
    rows.append(_row("Total token throughput (tok/s):", result["total_token_throughput"]))
    for metric in _TITLES:
        rows.extend(_latency_rows(result, metric, percentiles))
    by_turn = result.get("median_ttft_ms_by_turn") or {}
    if by_turn:
        rows.append(_section("TTFT by turn (median)"))
        rows.extend(_row(f"Turn {turn} (ms):", float(ms)) for turn, ms in by_turn.items())
    stages = result.get("mean_breakdown_ms") or {}
    if stages:
        rows.append(_section("TTFT breakdown (server, mean)"))
        rows.extend(_row(f"{stage} (ms):", float(ms)) for stage, ms in stages.items())
    rows.append("=" * _WIDTH)
    return "\n".join(rows)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: list[float], title: str) -> None:
    ordered = sorted(values_ms)
    n = len(ordered)
    ax.plot(ordered, [(i + 1) / n for i in range(n)], drawstyle="steps-post")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)


def plot_run(result: dict[str, Any], out_dir: str | Path) -> Path:
    """latency_cdf.png: CDFs of TTFT, TPOT, ITL and E2EL of the successful requests."""
    plt = _pyplot()
    ok = [not e for e in result["errors"]]
    ttfts = [t for t, s in zip(result["ttfts"], ok, strict=True) if s]
    e2els = [t for t, s in zip(result["e2els"], ok, strict=True) if s]
    outs = [n for n, s in zip(result["output_lens"], ok, strict=True) if s]
    tpots = [(e - t) / (n - 1) for t, e, n in zip(ttfts, e2els, outs, strict=True) if n > 1]
    itls = [g for gaps, s in zip(result["itls"], ok, strict=True) if s for g in gaps]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(
        axes.flat, [("TTFT", ttfts), ("TPOT", tpots), ("ITL", itls), ("E2EL", e2els)], strict=True
    ):
        _cdf(ax, [v * 1000.0 for v in values] or [0.0], name)
    fig.text(0.01, 0.01, caption([result], has_bars=False), fontsize=8, alpha=0.8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = Path(out_dir) / "latency_cdf.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rate(run: dict[str, Any]) -> float:
    rate = run["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def _fmt_ms(run: dict[str, Any], key: str) -> str:
    value = run.get(key)
    return "-" if value is None else f"{value:.1f}"


def format_sweep_markdown(runs: list[dict[str, Any]]) -> str:
    """A markdown table of a sweep (one row per run), then the mean TTFT breakdowns if any."""
    cols = ["mode", "rate (req/s)", "input", "output", "done", "req/s", "out tok/s"]
    cols += ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "E2EL p50", "goodput"]
    measured = "Simulated" if _tag(runs) else "Measured"
    lines = [f"{measured}: {caption(runs, has_bars=False)}.", ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        goodput = r.get("request_goodput")
        cells = [r["mode"], str(r["request_rate"]), str(r["input_len"]), str(r["output_len"])]
        cells += [f"{r['completed']}/{r['completed'] + r.get('failed', 0)}"]
        cells += [f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}"]
        cells += [_fmt_ms(r, "median_ttft_ms"), _fmt_ms(r, "p99_ttft_ms")]
        cells += [_fmt_ms(r, "median_tpot_ms"), _fmt_ms(r, "p99_tpot_ms")]
        cells += [_fmt_ms(r, "median_itl_ms"), _fmt_ms(r, "median_e2el_ms")]
        cells += ["-" if goodput is None else f"{goodput:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Latencies in ms. TTFT/TPOT per request; TPOT = (E2EL - TTFT) / (output - 1).")
    if any(r.get("mean_breakdown_ms") for r in runs):
        lines += ["", _breakdown_markdown(runs)]
    return "\n".join(lines) + "\n"


def _breakdown_markdown(runs: list[dict[str, Any]]) -> str:
    cols = ["mode", "rate", "input", "mean TTFT", *BREAKDOWN_STAGES]
    lines = ["Mean TTFT breakdown (ms, server-side):", ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        stages = r.get("mean_breakdown_ms") or {}
        cells = [r["mode"], str(r["request_rate"]), str(r["input_len"]), _fmt_ms(r, "mean_ttft_ms")]
        cells += [_fmt_ms(stages, stage) for stage in BREAKDOWN_STAGES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failure_summary(result: dict[str, Any], most: int = 5) -> str:
    """The distinct error messages of failed requests, most frequent first, with counts: a
    table of zeros must say why ("" when nothing failed)."""
    counts: dict[str, int] = {}
    for error in result.get("errors") or []:
        if error:
            counts[error] = counts.get(error, 0) + 1
    if not counts:
        return ""
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    lines = [f"{sum(counts.values())} request(s) failed:"]
    lines += [f"  {n} x {message[:300]}" for message, n in ranked[:most]]
    if len(ranked) > most:
        lines.append(f"  ... and {len(ranked) - most} other distinct error(s)")
    return "\n".join(lines)


def _tag(runs: list[dict[str, Any]]) -> str:
    """Marks plots of `disagg sim` results: a simulated figure never passes for a measured one."""
    return ", SIMULATED" if all(r.get("simulated") for r in runs) else ""


def _per_request_ms(run: dict[str, Any], key: str) -> list[float]:
    """Each request's TTFT or TPOT (ms) from a result's per-request lists (empty if absent)."""
    ttfts = run.get("ttfts") or []
    if key == "median_ttft_ms":
        return [t * 1e3 for t in ttfts if t and t > 0]
    triples = zip(ttfts, run.get("e2els") or [], run.get("output_lens") or [], strict=False)
    return [(e - t) / (n - 1) * 1e3 for t, e, n in triples if t and t > 0 and n and n > 1]


def _quartiles(values: list[float], median: float) -> tuple[float, float]:
    """(median - p25, p75 - median): error bar lengths; zero without per-request values."""
    if len(values) < 2:
        return 0.0, 0.0
    ordered = sorted(values)
    p25, p75 = (ordered[round(q * (len(ordered) - 1))] for q in (0.25, 0.75))
    return max(0.0, median - p25), max(0.0, p75 - median)


def caption(runs: list[dict[str, Any]], *, has_bars: bool = True) -> str:
    """What every figure must say: model, requests per point, output length, and the machine
    (measured: the bench's host as the result records it; simulated: the hardware profile);
    `has_bars` adds what its error bars are."""
    first = runs[0]
    counts = sorted({int(r.get("num_prompts") or 0) for r in runs})
    parts = [
        f"model {Path(str(first.get('model_id') or '?')).name}",
        f"{'/'.join(map(str, counts))} requests per point",
        f"{first.get('random_output_len', '?')} output tokens",
    ]
    parts += ["bars: per-request interquartile range"] if has_bars else []
    sim = first.get("sim")
    if isinstance(sim, dict):
        parts.append(f"{sim.get('hardware')} x tp {sim.get('tp')}")
    elif first.get("host"):  # results from before it was recorded name no machine
        parts.append(f"host {first['host']}")
    return "; ".join(parts)


def _plot_vs_rate(plt: Any, runs: list[dict[str, Any]], input_len: int, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, (key, name) in zip(
        axes, [("median_ttft_ms", "median TTFT"), ("median_tpot_ms", "median TPOT")], strict=True
    ):
        for mode in dict.fromkeys(r["mode"] for r in runs):
            chosen = sorted(
                (r for r in runs if r["mode"] == mode and r["input_len"] == input_len),
                key=_rate,
            )
            chosen = [r for r in chosen if math.isfinite(_rate(r))]
            if chosen:
                spread = [_quartiles(_per_request_ms(r, key), r[key]) for r in chosen]
                ax.errorbar(
                    [_rate(r) for r in chosen],
                    [r[key] for r in chosen],
                    yerr=list(zip(*spread, strict=True)),
                    marker="o",
                    capsize=3,
                    label=mode,
                )
        ax.set_title(f"{name} vs request rate (input {input_len} tokens){_tag(runs)}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)  # from zero: a small difference must not look like a large one
        ax.grid(alpha=0.3)
        ax.legend()
    fig.text(0.01, 0.01, caption(runs), fontsize=8, alpha=0.8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def breakdown_at_highest_load(
    runs: list[dict[str, Any]],
) -> tuple[float, int, dict[str, dict[str, float]]]:
    """(rate, input_len, {mode: {stage: mean ms}}) at the highest rate and, there, longest prompt.

    Stages are BREAKDOWN_STAGES plus "other": mean TTFT the servers did not account for
    (router, network, client), never negative.
    """
    top_rate = max(_rate(r) for r in runs)
    top_len = max(r["input_len"] for r in runs if _rate(r) == top_rate)
    per_mode: dict[str, dict[str, float]] = {}
    for r in runs:
        if _rate(r) == top_rate and r["input_len"] == top_len:
            stages = r.get("mean_breakdown_ms") or {}
            known = {s: float(stages[s]) for s in BREAKDOWN_STAGES if s in stages}
            known["other"] = max(0.0, r["mean_ttft_ms"] - sum(known.values()))
            per_mode[r["mode"]] = known
    return top_rate, top_len, per_mode


def _plot_breakdown(plt: Any, runs: list[dict[str, Any]], path: Path) -> Path:
    """Stacked mean TTFT breakdown, one bar per mode, at the highest load of the sweep."""
    rate, input_len, per_mode = breakdown_at_highest_load(runs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = list(per_mode)
    bottoms = [0.0] * len(modes)
    for stage in (*BREAKDOWN_STAGES, "other"):
        heights = [per_mode[m].get(stage, 0.0) for m in modes]
        if any(heights):
            ax.bar(modes, heights, bottom=bottoms, label=stage)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_title(f"mean TTFT breakdown at {rate:g} req/s, input {input_len} tokens{_tag(runs)}")
    ax.set_ylabel("ms")
    ax.legend()
    fig.text(0.01, 0.01, caption(runs, has_bars=False), fontsize=8, alpha=0.8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(runs: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """ttft_tpot_vs_rate_in{L}.png per prompt length, and ttft_breakdown.png; returns paths."""
    if not runs:
        raise ValueError("plot_sweep: no runs")
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for input_len in sorted({r["input_len"] for r in runs}):
        path = out / f"ttft_tpot_vs_rate_in{input_len}.png"
        paths.append(_plot_vs_rate(plt, runs, input_len, path))
    paths.append(_plot_breakdown(plt, runs, out / "ttft_breakdown.png"))
    return paths
