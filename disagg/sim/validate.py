"""`disagg sim [flags] validate --sweep SWEEP.json`: predict every point of a measured bench
sweep and compare medians. Held out: nothing here feeds back into a profile.

Each measured entry's own workload (prompts, lengths, seed, rate) is simulated on the
deployment the sim's flags describe; the output lists {mode, request_rate, input_len, metric,
measured, predicted, error} for median TTFT and median TPOT, TTFT rows with both breakdowns.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from disagg.sim.sim_config import SimConfig
from disagg.sim.sweep import simulate_point

__all__ = ["add_arguments", "compare", "run", "summarize"]

METRICS = ("median_ttft_ms", "median_tpot_ms")


def _predict(base: SimConfig, measured: dict[str, Any]) -> dict[str, Any]:
    return simulate_point(
        base,
        measured["mode"],
        float(measured["request_rate"]),
        int(measured["random_input_len"]),
        num_prompts=int(measured["num_prompts"]),
        output_len=int(measured["random_output_len"]),
        range_ratio=float(measured["random_range_ratio"]),
        seed=int(measured["seed"]),
    )


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for metric in METRICS:
        row: dict[str, Any] = {k: measured[k] for k in ("mode", "request_rate", "input_len")}
        m, p = float(measured[metric]), float(predicted[metric])
        row |= {"metric": metric, "measured": m, "predicted": p, "error": p / m - 1}
        if metric == "median_ttft_ms":
            row["stages_measured_ms"] = measured.get("mean_breakdown_ms", {})
            row["stages_predicted_ms"] = predicted.get("mean_breakdown_ms", {})
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines = ["| mode | rate | input | metric | measured | predicted | error |", "|" + "---|" * 7]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['request_rate']} | {r['input_len']} | {r['metric']} "
            f"| {r['measured']:.1f} | {r['predicted']:.1f} | {r['error']:+.0%} |"
        )
    lines.append(
        f"\nmedian |error| {statistics.median(errors):.1%}; worst {abs(worst['error']):.1%} "
        f"({worst['mode']}, rate {worst['request_rate']}, input {worst['input_len']}, "
        f"{worst['metric']}); {sum(e <= 0.3 for e in errors)}/{len(errors)} points within 30%"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", required=True, help="a `disagg bench sweep` JSON list")
    parser.add_argument("--out", required=True, help="write the comparison rows here")


def run(args: argparse.Namespace, base: SimConfig) -> int:
    measured_runs = json.loads(Path(args.sweep).read_text())
    rows = []
    for measured in measured_runs:
        rows += compare(measured, _predict(base, measured))
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(summarize(rows))
    return 0
