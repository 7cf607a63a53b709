"""A bounded mixed soak: real push and pull clusters under good, cancelled and bad requests.

Starts, all on 127.0.0.1 (port 0, one torch thread each, every child dies with this process):
an aggregated reference instance; a push cluster (prefill + 2 decode, one with policy
recompute) and a pull cluster (prefill + 3 decode: plain, recompute with every transfer
failing (the fail_transfer test hook, kv/faults.py), and fail_transfer with policy fail), each
behind `disagg route`. Then
--concurrency client threads loop for --duration-s, each picking at random: a greedy completion
(token-id prompt, streamed or not, via either router) whose 200 must match the reference
instance's text; a client that hangs up mid-stream; or a bad input (a rotating list) that must
get a 4xx in the OpenAI error shape (or, for the odd-but-valid ones, be served with the
reference text); or a client that hangs up before the first byte (in pull mode: during the
prefill leg or the handoff to decode). Bad inputs include a huge prompt and a huge stop list,
a request id reused right after its client hung up, a replayed signed internal call, odd
Authorization headers (router-push asks for an API key, handed over in its environment) and
top_p=1e-300. Once, in the middle third, a push decode instance is SIGKILLed. Every request
has a client deadline; passing it counts as hung. Every child's RSS is sampled every few
seconds during the load (first after warm-up / peak / at half time / last). At the end: the
counts, each surviving instance's pool after a settle wait, and RSS / threads / open fds of
every surviving child after warm-up and at the end. Prints a table; the last stdout line is the
JSON document (also written to --out). Exit status 1 if anything hung, a 200 had wrong text, a
bad input was misanswered, a child died unasked, a pool was not full again, or a child's RSS
grew by more than RSS_GROWTH_MIB over the second half of the load (a leak, not a warm-up).

    python benchmarks/soak.py [--duration-s 600] [--model DIR] [--concurrency 4] [--seed 0]
                              [--client-timeout-s 60] [--transport tcp|nixl]
                              [--out docs/results/soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from child_procs import make_tiny_model
from soak_cluster import FAULTY, PLAN, Child, start_children, stop_children
from soak_load import run_load, warm_up
from soak_report import print_table, report
from soak_state import Soak

ROOT = Path(__file__).resolve().parents[1]


def _say(line: str, started: float = time.monotonic()) -> None:
    print(f"soak [{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)


def _soak(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    children: list[Child] = []
    token = secrets.token_urlsafe(24)  # the cluster's; the soak signs a replayed call with it
    try:
        start_children(model_dir, args, log_dir, children, token)
        soak = Soak(children, vocab_size, args.client_timeout_s, token)
        _say(f"{len(children)} children ready; warming up")
        warm_up(soak)
        start = {child.name: child.proc_stats() for child in children}
        _say(f"load for {args.duration_s:g} s")
        run_load(soak, args)
        _say("load done; settling")
        return report(soak, start)
    finally:
        stop_children(children)


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="soak-logs-"))  # kept: the children's logs
    with tempfile.TemporaryDirectory(prefix="soak-model-") as tmp:
        model_dir = Path(args.model or Path(tmp) / "model")
        if not args.model:
            make_tiny_model(model_dir)
        _say(f"model {model_dir}, logs in {log_dir}")
        result = _soak(model_dir, args, log_dir)
    config = {k: _shown_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    # Where this machine kept things is no result: the record names no local path.
    config["cpus"], config["log_dir"] = os.cpu_count(), "(a temporary directory)"
    config["plan"] = [" ".join([n, role, *extra, *(["fail_transfer"] if n in FAULTY else [])])
                      for n, role, _, extra in PLAN]  # fmt: skip
    command = shlex.join(["python", "benchmarks/soak.py", *sys.argv[1:]])
    return {"command": command, "config": config, "results": result}


def _shown_path(path: Path) -> str:
    """A path as the record shows it: relative to the checkout when inside it, else redacted."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return "(a local path)"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--model", default="", help="a model dir (default: a tiny random one)")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-timeout-s", type=float, default=60.0, help="past it: hung")
    parser.add_argument("--transport", choices=("tcp", "nixl"), default="tcp")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "soak.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: children are stopped
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    started = time.monotonic()
    try:
        doc = run(args)
    except KeyboardInterrupt:
        _say("interrupted; every child stopped")
        return 130
    doc["config"]["wall_s"] = round(time.monotonic() - started, 1)
    res = doc["results"]
    print_table(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    bad = res["hung"] or res["wrong_token_200"] or res["bad_input_misanswered"]
    is_unwell = res["children_died"] or not res["pools_full"] or res["rss_growing"]
    return 1 if bad or is_unwell else 0


if __name__ == "__main__":
    sys.exit(main())
