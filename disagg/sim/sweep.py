"""`disagg sim [flags] sweep`: simulate mode x prompt length x request rate, as `disagg bench
sweep` measures it, into one JSON list (each entry: mode, request_rate, input_len, output_len,
then the bench keys). The aggregated baseline gets as many instances as the disaggregated
modes have in all, as the bench sweep deploys it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from disagg.sim.cluster import run_simulation
from disagg.sim.sim_config import SimConfig

__all__ = ["add_arguments", "deployment", "run", "simulate_point"]

# Per-request lists the bench keeps for plots; a long sim run would make the file huge.
_PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "errors", "breakdowns")


def deployment(base: SimConfig, mode: str) -> SimConfig:
    """`base` in `mode`; aggregated runs num_prefill + num_decode instances."""
    if mode == "aggregated":
        return replace(base, mode="aggregated", num_prefill=base.num_instances, num_decode=0)
    return replace(base, mode=mode)  # type: ignore[arg-type]


def simulate_point(
    base: SimConfig, mode: str, request_rate: float, input_len: int, **workload: Any
) -> dict[str, Any]:
    """One grid point, bench-keyed; `workload` overrides WorkloadConfig fields (e.g. seed)."""
    w = replace(base.workload, input_len=input_len, **workload)
    config = replace(deployment(base, mode), request_rate=request_rate, workload=w)
    result, _ = run_simulation(config)
    head = {"mode": mode, "request_rate": request_rate, "input_len": input_len}
    return {**head, "output_len": w.output_len, **result}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="aggregated,pull,push")
    parser.add_argument("--request-rates", default="0.5,1.5,3")
    parser.add_argument("--input-lens", default="256,1024,4096")
    parser.add_argument("--out", required=True, help="JSON list of bench-keyed results")
    parser.add_argument(
        "--plot-dir", default=None, help="also write disagg bench sweep's plots here (marked)"
    )
    parser.add_argument(
        "--keep-per-request", action="store_true", help="keep ttfts/itls/... per request"
    )


def run(args: argparse.Namespace, base: SimConfig) -> int:
    runs = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        for input_len in [int(v) for v in args.input_lens.split(",")]:
            for rate in [float(v) for v in args.request_rates.split(",")]:
                result = simulate_point(base, mode, rate, input_len)
                if not args.keep_per_request:
                    result = {k: v for k, v in result.items() if k not in _PER_REQUEST_KEYS}
                runs.append(result)
                print(
                    f"{mode:>10} in={input_len:>6} rate={rate:>5}: "
                    f"ttft p50 {result['median_ttft_ms']:.1f} ms, "
                    f"tpot p50 {result['median_tpot_ms']:.2f} ms "
                    f"({result['sim']['wall_s']:.1f} s wall)"
                )
    Path(args.out).write_text(json.dumps(runs, indent=1) + "\n")
    print(f"wrote {len(runs)} runs to {args.out}")
    if args.plot_dir:
        from disagg.bench import report  # matplotlib: only when plots are asked for

        for path in report.plot_sweep(runs, args.plot_dir):
            print(f"wrote {path}")
    return 0
