"""Where our server's time goes under load: one aggregated server, the peer benchmark's workload
(32 prompts of 256 tokens, 64 out, rate inf), sampled by py-spy, each sample sorted by thread
and by what the engine thread was doing.

The question it answers: does the HTTP side (asyncio: parsing, tokenizing, detokenizing,
streaming) take time from the engine loop it shares an interpreter with? If the event loop is
busy for a large share of the engine's step time, an engine core in its own process (as vLLM
and SGLang run it) would pay; if it sits in `select`, there is nothing to overlap.

py-spy is not a dependency of this project: install it anywhere (`pip install py-spy`) and pass
`--py-spy PATH` (default: the one on PATH). Sampling needs ptrace rights over the server (root,
or a kernel that allows it). Without py-spy this prints one line and exits 0.

    python benchmarks/server_profile.py [--dtype auto] [--busy-cores 1]
        [--out docs/results/server_profile.json]

`--busy-cores N` runs N spinning processes beside the server during the sampled run: the
machine under outside load, where a shared interpreter should hurt most.

Prints a table; the last stdout line is the JSON document.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer_bench import Server

from disagg.bench.host import cpu_info
from disagg.engine.checkpoint import resolve_model

_HOST = "127.0.0.1"
_WORKLOAD = ["--input-len", "256", "--output-len", "64", "--num-prompts", "32"]

# What the engine thread was doing, by the first matching frame of a sample (most specific
# first): name -> substring of a frame.
_ENGINE_PARTS = [
    ("attention kernel: prefill", "PagedAttention.prefill"),
    ("attention kernel: decode", "PagedAttention.decode"),
    ("attention: prefill, outside the kernel", "_prefill_attention"),
    ("attention: KV scatter", "_attention (disagg/engine/model_runner.py"),
    ("GEMMs (packed linear)", "PackedLinear.forward"),
    ("GEMMs (plain linear)", "linear (torch"),
    ("vocabulary projection", "compute_logits"),
    ("sampling", "sampler.py"),
    ("RoPE", "rotate (disagg/engine/rope.py"),
    ("add + RMSNorm", "RMSNorm.add_and_norm"),
    ("RMSNorm", "RMSNorm.forward"),
    ("MLP pointwise (SiLU, mul)", "MLP.forward"),
    ("model: residual adds, reshapes", "model.py"),
    ("step inputs (lists to tensors)", "_prepare"),
    ("scheduler", "scheduler.py"),
]


def classify(stack: str) -> tuple[str, str]:
    """(thread kind, part) of one py-spy sample's collapsed stack."""
    thread = stack.split(";", 1)[0]
    if "engine-loop" in thread:
        if "_run (disagg/engine/async_engine.py" not in stack or "Engine.step" not in stack:
            return "engine", "idle or between steps"
        part = next((name for name, frame in _ENGINE_PARTS if frame in stack), "step: other")
        return "engine", part
    if "MainThread" in thread:
        idle = stack.rsplit(";", 1)[-1].startswith(("EpollSelector.select", "select ("))
        return "event loop", "idle (select)" if idle else "busy"
    return "other threads", "any"


def summarize(raw: str) -> dict:
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[classify(stack)] += int(n)
    stepping = sum(n for (kind, part), n in counts.items() if kind == "engine" and
                   part != "idle or between steps")  # fmt: skip
    busy_loop = counts[("event loop", "busy")]
    parts = {part: n / stepping for (kind, part), n in counts.items() if kind == "engine" and
             part != "idle or between steps"}  # fmt: skip
    return {
        "samples": {f"{k}: {p}": n for (k, p), n in counts.items()},
        "engine_stepping_samples": stepping,
        "event_loop_busy_vs_engine_stepping": busy_loop / stepping if stepping else float("nan"),
        "engine_step_parts": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
    }


def run(args: argparse.Namespace, spy: str) -> dict:
    model_dir = str(resolve_model(args.model))
    logs = Path(tempfile.mkdtemp(prefix="server-profile-"))
    argv = [sys.executable, "-m", "disagg.cli", "serve", "--role", "both", "--model", model_dir,
            "--served-model-name", args.model, "--num-threads", "1", "--host", _HOST,
            "--port", str(args.port), "--dtype", args.dtype]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = Server("disagg", argv, env, args.port, logs / "server.log")
    bench = [sys.executable, "-m", "disagg.cli", "bench", "--base-url", server.url, "--model",
             args.model, "--no-progress", *_WORKLOAD, "--request-rate", "inf"]  # fmt: skip
    server.start()
    try:
        server.wait_ready(600)
        subprocess.run([*bench, "--num-prompts", "4", "--seed", "10000"], check=True,
                       stdout=subprocess.DEVNULL, timeout=600)  # fmt: skip
        assert server.proc is not None
        raw_path = logs / "samples.txt"
        sampler = subprocess.Popen(
            [spy, "record", "-p", str(server.proc.pid), "--threads", "--idle", "-r", "100",
             "-f", "raw", "-o", str(raw_path), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        time.sleep(1)  # attached before the load starts
        spin = [sys.executable, "-c", "while True: pass"]
        spinners = [subprocess.Popen(spin) for _ in range(args.busy_cores)]
        result_file = logs / "bench.json"
        try:
            subprocess.run([*bench, "--seed", str(args.seed), "--result-file", str(result_file)],
                           check=True, stdout=subprocess.DEVNULL, timeout=900)  # fmt: skip
        finally:
            for spinner in spinners:
                spinner.kill()
        sampler.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        sampler.wait(60)
        summary = summarize(raw_path.read_text())
        measured = json.loads(result_file.read_text())
    finally:
        server.stop()
    summary["bench"] = {k: measured[k] for k in ("output_throughput", "median_ttft_ms",
                                                 "median_tpot_ms")}  # fmt: skip
    return {"cpu": cpu_info(), "model": args.model, "dtype": args.dtype, "threads": 1,
            "busy_cores": args.busy_cores,
            "workload": " ".join([*_WORKLOAD, "--request-rate", "inf"]), **summary}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=4242)
    parser.add_argument("--port", type=int, default=20400)
    parser.add_argument("--busy-cores", type=int, default=0, help="spinning processes beside")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not args.py_spy:
        print("server_profile: no py-spy (pip install py-spy; --py-spy PATH): nothing measured")
        return
    result = run(args, args.py_spy)
    print(f"event loop busy / engine stepping: {result['event_loop_busy_vs_engine_stepping']:.1%}"
          f" ({result['engine_stepping_samples']} stepping samples)")  # fmt: skip
    for part, share in result["engine_step_parts"].items():
        print(f"  {share:6.1%}  {part}")
    cpu = result["cpu"]
    print(f"CPU: {cpu['model']} ({cpu['cpus']} cores; {' '.join(cpu['flags_shown'])})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
