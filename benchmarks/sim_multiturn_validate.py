"""The simulator against a real multi-turn run: each configuration of a `multiturn_bench.py`
result simulated on the same conversations (its rounds' seeds), through the same router policy
and scheduler code, with a CPU profile measured by `disagg sim calibrate` for the same model
and dtype; each figure compared with the real rounds' mean and their min-max band.

Held out: the profile comes from micro-measurements, never from this run. The simulated
instances get the real ones' defaults (16-token blocks, 1024 of them, 512 batched tokens, 64
sequences). Writes JSON; the last stdout line is the JSON.

    python benchmarks/sim_multiturn_validate.py --real docs/results/multiturn.json \
        --hardware PROFILE.toml --dtype bfloat16 [--out docs/results/sim_multiturn_validation.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from multiturn_bench import config_of

from disagg.bench.workload import WorkloadConfig
from disagg.sim.cluster import run_simulation
from disagg.sim.sim_config import SimConfig

FIGURES = ("median_ttft_ms_later_turns", "median_ttft_ms", "output_throughput")


def _model_at(model: str, dtype: str, root: Path) -> str:
    """The checkpoint's config.json at the dtype the real instances served in (KV bytes)."""
    from disagg.engine.checkpoint import resolve_model  # torch: only once we run

    config = json.loads((resolve_model(model) / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    path = root / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def simulate(name: str, seed: int, doc: dict[str, Any], model: str, hardware: str) -> dict:
    fields = config_of(name) or {}
    w = doc["config"]["workload"]
    workload = WorkloadConfig(
        dataset="multiturn", num_prompts=w["conversations"], num_turns=w["turns"],
        prefix_len=w["system_len"], input_len=w["user_len"], output_len=w["answer_len"],
        seed=seed,
    )  # fmt: skip
    mode = fields.get("mode", "aggregated")
    num_decode = fields.get("num_decode", 1)
    config = SimConfig(
        mode=mode, model=model, hardware=hardware, layout="ours",
        num_prefill=fields.get("num_prefill", 1) if mode != "aggregated" else num_decode,
        num_decode=num_decode if mode != "aggregated" else 0,
        policy=fields.get("policy", "round_robin"),
        local_prefill_tokens=fields.get("local_prefill_tokens", 0),
        num_blocks=1024, max_num_batched_tokens=512, max_num_seqs=64, workload=workload,
    )  # fmt: skip
    result, _ = run_simulation(config)
    return result


def compare(doc: dict[str, Any], model: str, hardware: str) -> list[dict[str, Any]]:
    rows = []
    for name in doc["config"]["configs"]:
        runs = [r for r in doc["runs"] if r["config"] == name]
        predicted = [simulate(name, r["round"], doc, model, hardware) for r in runs]
        for figure in FIGURES:
            real = [r[figure] for r in runs]
            sim = statistics.fmean(p[figure] for p in predicted)
            mean, low, high = statistics.fmean(real), min(real), max(real)
            rows.append({"config": name, "figure": figure, "measured": mean,
                         "measured_min": low, "measured_max": high, "predicted": sim,
                         "error": sim / mean - 1, "in_band": low <= sim <= high})  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | figure | measured mean (min-max) | predicted | error | in band |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['config']} | {r['figure']} | {r['measured']:.1f} "
                     f"({r['measured_min']:.1f}-{r['measured_max']:.1f}) | {r['predicted']:.1f} "
                     f"| {r['error']:+.0%} | {'yes' if r['in_band'] else 'no'} |")  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    in_band = sum(r["in_band"] for r in rows)
    lines.append(f"\nmedian |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}, "
                 f"{sum(e <= 0.3 for e in errors)}/{len(rows)} within 30%, "
                 f"{in_band}/{len(rows)} inside the measured band")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", type=Path, required=True, help="a multiturn_bench.py result")
    parser.add_argument("--hardware", required=True, help="a CPU profile for the same model")
    parser.add_argument("--dtype", default="bfloat16", help="what the real instances ran in")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    doc = json.loads(args.real.read_text())
    with tempfile.TemporaryDirectory() as root:
        model = _model_at(doc["config"]["model"], args.dtype, Path(root))
        rows = compare(doc, model, args.hardware)
    md = table(rows)
    print(md)
    result = {"real": args.real.name, "hardware": Path(args.hardware).name, "rows": rows,
              "table": md}  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
