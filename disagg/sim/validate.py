"""`disagg sim [flags] validate --sweep A.json [B.json ...]`: predict every point of measured bench
sweeps and compare with their mean, in percent and in units of the real run-to-run spread.

Several sweeps of the same grid (same seeds, run at different hours) give each point a mean
and a band (min..max over the sweeps): a prediction inside the band is as good as a rerun.
Each point's own workload (prompts, lengths, seed, rate) is simulated once on the deployment the
sim's flags describe. Rows: {mode, request_rate, input_len, metric, measured (the mean),
measured_min, measured_max, predicted, error, in_band, spread_units}; TTFT rows carry both
breakdowns. Held out: nothing here feeds back into a profile.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from disagg.sim.sim_config import SimConfig
from disagg.sim.sweep import simulate_point

__all__ = ["add_arguments", "compare", "group_points", "run", "summarize"]

METRICS = ("median_ttft_ms", "median_tpot_ms")
_KEY = ("mode", "request_rate", "input_len")


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


def group_points(sweeps: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """The runs of each point, one per sweep that has it, in the first sweep's order."""
    keyed: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for sweep in sweeps:
        for entry in sweep:
            keyed.setdefault(tuple(str(entry[k]) for k in _KEY), []).append(entry)
    return list(keyed.values())


def compare(runs: list[dict[str, Any]], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per metric: the prediction against the runs' mean and band."""
    rows = []
    first = runs[0]
    for metric in METRICS:
        values = [float(r[metric]) for r in runs]
        mean, low, high = statistics.fmean(values), min(values), max(values)
        p = float(predicted[metric])
        half_range = (high - low) / 2
        row: dict[str, Any] = {k: first[k] for k in _KEY}
        row |= {"metric": metric, "measured": mean, "measured_min": low, "measured_max": high,
                "num_runs": len(values), "predicted": p, "error": p / mean - 1,
                "in_band": low <= p <= high,
                "spread_units": (p - mean) / half_range if half_range > 0 else None}  # fmt: skip
        if metric == "median_ttft_ms":
            row["stages_measured_ms"] = _mean_stages(runs)
            row["stages_predicted_ms"] = predicted.get("mean_breakdown_ms", {})
        rows.append(row)
    return rows


def _mean_stages(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each TTFT stage's mean over the runs that report it, as `measured` is the runs' mean."""
    names = dict.fromkeys(name for r in runs for name in r.get("mean_breakdown_ms", {}))
    return {
        name: statistics.fmean(
            r["mean_breakdown_ms"][name] for r in runs if name in r.get("mean_breakdown_ms", {})
        )
        for name in names
    }


def _line(r: dict[str, Any]) -> str:
    units = "-" if r["spread_units"] is None else f"{r['spread_units']:+.1f}"
    return (f"| {r['mode']} | {r['request_rate']} | {r['input_len']} | {r['metric']} "
            f"| {r['measured']:.1f} | {r['measured_min']:.1f}-{r['measured_max']:.1f} "
            f"| {r['predicted']:.1f} | {r['error']:+.0%} | {units} |")  # fmt: skip


def _summary(label: str, rows: list[dict[str, Any]]) -> str:
    errors = [abs(r["error"]) for r in rows]
    in_band = sum(r["in_band"] for r in rows)
    signed = statistics.median(r["error"] for r in rows)
    return (f"| {label} | {len(rows)} | {statistics.median(errors):.1%} | {max(errors):.1%} "
            f"| {signed:+.1%} | {sum(e <= 0.3 for e in errors)} | {in_band} |")  # fmt: skip


def summarize(rows: list[dict[str, Any]]) -> str:
    """The table of every row, then per mode and over all: median and worst |error|, signed
    median, rows within 30%, rows inside the measured band."""
    lines = ["| mode | rate | input | metric | measured mean | measured min-max | predicted "
             "| error | spread units |", "|" + "---|" * 9]  # fmt: skip
    lines += [_line(r) for r in rows]
    lines += ["", "| rows | n | median abs error | worst | signed median | within 30% "
              "| inside the band |", "|" + "---|" * 7]  # fmt: skip
    for mode in dict.fromkeys(r["mode"] for r in rows):
        lines.append(_summary(mode, [r for r in rows if r["mode"] == mode]))
    lines.append(_summary("all", rows))
    runs = max(r["num_runs"] for r in rows)
    lines.append(f"\nmeasured: the mean of {runs} sweep(s) per point; the band is their "
                 "min-max; spread units: (predicted - mean) / half the band")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", required=True, nargs="+", action="extend",
                        help="`disagg bench sweep` JSON lists of one grid (several: their "
                        "mean and spread)")  # fmt: skip
    parser.add_argument("--out", required=True, help="write the comparison rows here")


def run(args: argparse.Namespace, base: SimConfig) -> int:
    sweeps = [json.loads(Path(path).read_text()) for path in args.sweep]
    rows = []
    for runs in group_points(sweeps):
        rows += compare(runs, _predict(base, runs[0]))
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(summarize(rows))
    return 0
