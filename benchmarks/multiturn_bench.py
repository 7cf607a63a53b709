"""Multi-turn conversations on live local clusters, configurations alternated in one run.

Each configuration (a mode, its instance counts, a routing policy) gets a fresh cluster from
`disagg up`'s launcher, then `disagg bench --dataset multiturn` against it: N conversations of
T turns, a shared system prompt, each turn's prompt the history with the answers actually
returned. Rounds alternate the configurations (A B C, A B C, ...) so drift of the machine hits
all alike; the figures are per-round medians and their ratios to the first configuration.
What it shows: how much of each turn's history the placement lets a prefix cache reuse (the
median TTFT of turns >= 2 against turn 1), beside throughput, KV bytes moved between instances
and prompt tokens computed per request (from the servers' breakdowns).

`pull-kv-localN` is pull under kv_aware with `--local-prefill-tokens N` (conditional
disaggregation), `agg2-kv-rtN` agg2-kv with `--kv-aware-request-tokens N`; `agg2-vr` is the
vLLM project's router (`--vllm-router PATH`, policy cache_aware) in front of two of our
aggregated instances, the peer of `agg2-kv`.

    python benchmarks/multiturn_bench.py [--configs pull-ll,pull-kv,pull-kv-local128,agg2-kv]
        [--rounds 2] [--conversations 8 --turns 6 --system-len 512 --user-len 64
        --answer-len 32] [--vllm-router PATH] [--out docs/results/multiturn.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# benchmarks/ is on sys.path when this file runs as a script.
from child_procs import tree_cpu_seconds
from live_cluster import format_cell, provenance, write_result

from disagg.bench.host import cpu_info
from disagg.bench.runner import BenchConfig, run_benchmark
from disagg.bench.workload import WorkloadConfig
from disagg.cluster.config import ClusterConfig
from disagg.cluster.launcher import Cluster

CONFIGS: dict[str, dict[str, Any]] = {
    "agg2-rr": {"mode": "aggregated", "num_decode": 2, "policy": "round_robin"},
    "agg2-ll": {"mode": "aggregated", "num_decode": 2, "policy": "least_loaded"},
    "agg2-kv": {"mode": "aggregated", "num_decode": 2, "policy": "kv_aware"},
    "pull-ll": {"mode": "pull", "num_prefill": 1, "num_decode": 2, "policy": "least_loaded"},
    "push-ll": {"mode": "push", "num_prefill": 1, "num_decode": 2, "policy": "least_loaded"},
    "pull-kv": {"mode": "pull", "num_prefill": 1, "num_decode": 2, "policy": "kv_aware"},
    "push-kv": {"mode": "push", "num_prefill": 1, "num_decode": 2, "policy": "kv_aware"},
    # the peer router in front of two of our instances (ours runs too, unused)
    "agg2-vr": {"mode": "aggregated", "num_decode": 2, "policy": "round_robin"},
}
_LOCAL = "pull-kv-local"  # + N: pull-kv with --local-prefill-tokens N
_WEIGHT = "agg2-kv-rt"  # + N: agg2-kv with --kv-aware-request-tokens N
_FIGURES = ("median_ttft_ms_later_turns", "median_ttft_ms", "output_throughput",
            "kv_bytes_per_request", "prefill_tokens_per_request", "front_cpu_s",
            "instances_cpu_s")  # fmt: skip


def config_of(name: str) -> dict[str, Any] | None:
    """A configuration's ClusterConfig fields, or None for an unknown name."""
    if name in CONFIGS:
        return CONFIGS[name]
    tokens = name.removeprefix(_LOCAL)
    if name.startswith(_LOCAL) and tokens.isdigit():
        return {**CONFIGS["pull-kv"], "local_prefill_tokens": int(tokens)}
    weight = name.removeprefix(_WEIGHT)
    if name.startswith(_WEIGHT) and weight.isdigit():
        return {**CONFIGS["agg2-kv"], "router_args": ("--kv-aware-request-tokens", weight)}
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    names = args.configs.split(",")
    unknown = sorted(n for n in names if config_of(n) is None)
    if unknown:
        known = f"{sorted(CONFIGS)}, {_LOCAL}N, {_WEIGHT}N"
        print(f"multiturn_bench: unknown configs {unknown}; known: {known}")
        return 2
    if "agg2-vr" in names and not (args.vllm_router and Path(args.vllm_router).exists()):
        print("multiturn_bench: agg2-vr skipped: no --vllm-router binary given")
        names.remove("agg2-vr")
    runs = [_run(name, r, args) for r in range(args.rounds) for name in names]
    rows = _medians(runs, names)
    print_table(rows)
    config = {"configs": {n: config_of(n) for n in names}, "rounds": args.rounds,
              "workload": _workload_keys(args), "model": args.model,
              "host": cpu_info(), **provenance(started, load_start)}  # fmt: skip
    # The peer's binary by name only: where it lies on this machine is nobody's business.
    config["argv"] = [Path(a).name if a == args.vllm_router else a for a in config["argv"]]
    write_result({"config": config, "results": rows, "runs": runs}, args.out)
    return 0 if all(run["failed"] == 0 for run in runs) else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="pull-ll,pull-kv-local64,pull-kv-local128,"
                   "pull-kv-local256,agg2-kv,agg2-kv-rt64,agg2-vr")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=512, help="shared system prompt, tokens")
    p.add_argument("--user-len", type=int, default=64, help="each user turn, tokens")
    p.add_argument("--answer-len", type=int, default=32, help="each answer, tokens")
    p.add_argument("--vllm-router", default="", help="the vllm-router binary, for agg2-vr")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _workload(args: argparse.Namespace, seed: int) -> WorkloadConfig:
    return WorkloadConfig(dataset="multiturn", num_prompts=args.conversations,
                          num_turns=args.turns, prefix_len=args.system_len,
                          input_len=args.user_len, output_len=args.answer_len,
                          seed=seed)  # fmt: skip


def _workload_keys(args: argparse.Namespace) -> dict[str, int]:
    return {"conversations": args.conversations, "turns": args.turns,
            "system_len": args.system_len, "user_len": args.user_len,
            "answer_len": args.answer_len}  # fmt: skip


def _run(name: str, round_index: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, one round: a fresh cluster, the same conversations as the other
    configurations of this round (seeded by the round), the bench's figures."""
    from disagg.engine.checkpoint import resolve_model  # torch: only once we run

    model_dir = str(resolve_model(args.model))
    log_dir = Path(tempfile.mkdtemp(prefix="multiturn-bench-"))
    fields = config_of(name) or {}
    config = ClusterConfig(model=args.model, port=0, log_dir=log_dir / f"{name}-{round_index}",
                           **fields)  # fmt: skip
    print(f"multiturn_bench: {name}, round {round_index + 1}/{args.rounds}", file=sys.stderr)
    with Cluster(config) as cluster, _front(name, cluster, args) as (url, front_pid):
        bench = BenchConfig(base_url=url, workload=_workload(args, round_index),
                            tokenizer=model_dir, warmup=2)  # fmt: skip
        instances = [pid for child, pid in cluster.pids.items() if child != "router"]
        cpu_before = _cpu(front_pid, instances)
        result = asyncio.run(run_benchmark(bench))
        cpu = {k: after - cpu_before[k] for k, after in _cpu(front_pid, instances).items()}
    keys = ("completed", "failed", "median_ttft_ms_by_turn", *_FIGURES[:3])
    return {"config": name, "round": round_index, **{k: result[k] for k in keys},
            **_moved_and_computed(result["breakdowns"]), **cpu}  # fmt: skip


def _cpu(front_pid: int, instance_pids: list[int]) -> dict[str, float]:
    """CPU-seconds so far of the router the bench sends to and of the instances together
    (the differences include the bench's two warm-up turns)."""
    return {"front_cpu_s": tree_cpu_seconds(front_pid),
            "instances_cpu_s": sum(tree_cpu_seconds(pid) for pid in instance_pids)}  # fmt: skip


def _moved_and_computed(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    """Per request, means over all of them (warm-up excluded): KV bytes moved between
    instances (none when prefilled where it decodes) and prompt tokens computed."""
    n = max(1, len(breakdowns))
    return {
        "kv_bytes_per_request": sum(b.get("num_bytes", 0.0) for b in breakdowns) / n,
        "prefill_tokens_per_request": sum(b.get("num_prefilled_tokens", 0.0) for b in breakdowns)
        / n,
    }


@contextlib.contextmanager
def _front(name: str, cluster: Cluster, args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """The URL the bench sends to and its router's pid: ours, or for agg2-vr the peer router
    started over the same instances (stopped after)."""
    if name != "agg2-vr":
        yield cluster.url, cluster.pids["router"]
        return
    from disagg.cluster.processes import free_port

    port = free_port()
    argv = [args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--policy",
            "cache_aware", "--worker-urls", *cluster.instance_urls["both"]]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_serving(url, proc)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_serving(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.3)
    raise RuntimeError(f"vllm-router at {url} not serving after {timeout_s}s")


def _medians(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per configuration: the median over rounds of each figure, and its ratio to the first
    configuration's (measured in the same rounds, side by side)."""
    rows = []
    for name in names:
        mine = [run for run in runs if run["config"] == name]
        rows.append(
            {"config": name, **{f: statistics.median(r[f] for r in mine) for f in _FIGURES}}
        )
    for row in rows:
        for figure in _FIGURES:
            base = rows[0][figure]
            row[f"{figure}_vs_{names[0]}"] = row[figure] / base if base else math.nan
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["config"]
    print(f"{'config':<18} {'TTFT turns>=2 ms':>17} {'TTFT all ms':>12} {'tok/s':>8} "
          f"{'KV KiB/req':>10} {'prefill tok/req':>15} {'router CPU s':>12} "
          f"{'inst CPU s':>10}   vs {base}: TTFT turns>=2, tok/s, "
          "KV bytes, prefill tokens")  # fmt: skip
    for row in rows:
        later = format_cell(row["median_ttft_ms_later_turns"], 17)
        shown = ("median_ttft_ms_later_turns", "output_throughput", "kv_bytes_per_request",
                 "prefill_tokens_per_request")  # fmt: skip
        ratios = ", ".join(f"{row[f'{f}_vs_{base}']:.2f}x" for f in shown)
        print(f"{row['config']:<18} {later} {format_cell(row['median_ttft_ms'], 12)} "
              f"{row['output_throughput']:>8.1f} {row['kv_bytes_per_request'] / 1024:>10.1f} "
              f"{row['prefill_tokens_per_request']:>15.1f} {row['front_cpu_s']:>12.1f} "
              f"{row['instances_cpu_s']:>10.1f}   {ratios}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
