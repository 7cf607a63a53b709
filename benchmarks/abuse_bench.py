"""Abuse under load: what the inputs of an adversarial run cost another client now that each is
refused, and whether an instance under a 3.5 GB address-space limit survives a 10 MB prompt.

Per mode (pull, then push; a fresh cluster each, built by the project's launcher on 127.0.0.1:
router + 1 prefill + 1 decode, one torch thread per instance, TCP transport, every limit at its
default), a victim client streams greedy completions of --victim-max-tokens tokens through the
router, one after another, and a poller asks P's and D's /health every HEALTH_EVERY_S. Then, per
attack: --quiet-s with nothing else sent (the baseline window), the attack (--repeats sends,
one after another), and TAIL_S more (a stall may outlast the answer). Recorded per attack: the
attack requests' statuses and latencies; the victim's inter-token gaps (client arrival times of
consecutive chunks of one stream, gaps overlapping the window) p50 / p99 / max in the attack
window against the baseline window just before, and their ratios; the slowest /health of P and
of D in each window. The attacks:
  a 15 MB text prompt and a 15 MB chat prompt, to the router, then to D directly;
  1.5M stop_token_ids; 1000 stop strings of 2000 characters (to the router);
  pull only: a signed prefill leg (shaped and signed as the router sends one) recorded, sent
  once, then NUM_REPLAYS copies to P, one to D (another destination) and one re-signed 60 s
  ago; P's free blocks after each step;
  both: a signed /v1/abort to D recorded, sent once, then NUM_REPLAYS copies, and one to P.
Last, an aggregated instance alone under RLIMIT_AS 3.5 GB gets a 10 MB text prompt and a 10 MB
chat prompt: statuses, alive after each, its memory (VmRSS, VmHWM, VmPeak), then a normal
request. The CPU's model and flags are read from /proc/cpuinfo at run time. Prints a table; the
last stdout line is the JSON document (also written to --out). Exit status 1 if an attack was
not refused as expected, the victim saw an error, or an instance died; timings never fail it.

    python benchmarks/abuse_bench.py [--model DIR] [--modes pull,push] [--repeats 5]
                                     [--quiet-s 3] [--out docs/results/abuse.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# benchmarks/ is on sys.path when this file runs as a script.
from abuse_attacks import Attack, Target, make_attacks
from abuse_clients import HEALTH_EVERY_S, HealthPoller, Victim
from abuse_limited import run_limited
from abuse_report import failures, print_table
from abuse_stats import gap_stats, gaps_overlapping, ratio, slowest_health, to_ms
from child_procs import HOST, START_TIMEOUT_S, TINY_MODEL_ARGS, make_tiny_model, memory_mib

from disagg.bench.host import cpu_info
from disagg.cluster.config import ClusterConfig
from disagg.cluster.launcher import Cluster
from disagg.config import API_KEY_ENV, CLUSTER_TOKEN_ENV

ROOT = Path(__file__).resolve().parents[1]
TAIL_S = 0.5  # after an attack's last answer, still its window
_SERVE_ARGS = ("--dtype", "float32", "--kv-host", HOST)  # fp32: as the e2e tests measure it


def _measure(attack: Attack, target: Target, victim: Victim, poller: HealthPoller,
             quiet_s: float) -> dict[str, Any]:  # fmt: skip
    """The quiet window, then the attack and its tail: one row."""
    quiet_start_s = time.monotonic()
    time.sleep(quiet_s)
    start_s = time.monotonic()
    outcome = attack.send(target)
    answered_s = time.monotonic()
    time.sleep(TAIL_S)
    end_s = time.monotonic()
    chunks, samples = list(victim.chunk_times), list(poller.samples)
    base = gap_stats(gaps_overlapping(chunks, quiet_start_s, start_s))
    during = gap_stats(gaps_overlapping(chunks, start_s, end_s))
    sent = outcome.pop("sent")
    statuses = Counter(str(status) for status, _, _ in sent)
    latencies = [elapsed_s for _, elapsed_s, _ in sent]
    health = {name: {"baseline": slowest_health(samples, name, quiet_start_s, start_s),
                     "attack": slowest_health(samples, name, start_s, end_s)}
              for name in poller.targets}  # fmt: skip
    return {
        "attack": attack.name, "statuses": dict(statuses), "expected_status": attack.expected,
        "is_refused": set(statuses) == {str(attack.expected)}, "message": sent[0][2],
        "latency_median_ms": to_ms(statistics.median(latencies)),
        "latency_max_ms": to_ms(max(latencies)),
        "window_s": round(end_s - start_s, 2), "attack_s": round(answered_s - start_s, 2),
        "victim_baseline": base, "victim_attack": during,
        "median_gap_ratio": ratio(during["median_ms"], base["median_ms"]),
        "p99_gap_ratio": ratio(during["p99_ms"], base["p99_ms"]),
        "max_gap_ratio": ratio(during["max_ms"], base["max_ms"]),
        "health": health, **outcome,
    }  # fmt: skip


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, log_dir: Path,
             token: str, attacks: list[Attack]) -> dict[str, Any]:  # fmt: skip
    config = ClusterConfig(mode=mode, model=str(model_dir), kv_transport="tcp",
                           threads_per_instance=1, serve_args=_SERVE_ARGS,
                           log_dir=log_dir / mode, startup_timeout_s=START_TIMEOUT_S)  # fmt: skip
    _say(f"{mode}: starting router + 1 prefill + 1 decode")
    with Cluster(config) as cluster:
        urls = cluster.instance_urls
        target = Target(cluster.url, urls["prefill"][0], urls["decode"][0], token, args.repeats)
        pids = cluster.pids
        memory_before = {name: memory_mib(pid) for name, pid in pids.items()}
        victim = Victim(cluster.url, args.victim_max_tokens)
        poller = HealthPoller({"prefill": target.prefill_url, "decode": target.decode_url})
        victim.start()
        poller.start()
        rows = []
        try:
            for attack in (a for a in attacks if mode in a.modes):
                _say(f"{mode}: {attack.name}")
                rows.append(
                    {"mode": mode, **_measure(attack, target, victim, poller, args.quiet_s)}
                )
        finally:
            victim.stop()
            poller.stop()
        died = cluster.dead_process()
        memory_after = {name: memory_mib(pid) for name, pid in pids.items() if not died}
    return {"rows": rows, "victim_streams": victim.num_streams, "victim_errors": victim.errors[:5],
            "died": died, "memory_mib_before": memory_before,
            "memory_mib_after": memory_after}  # fmt: skip


def _say(line: str, started: float = time.monotonic()) -> None:
    print(f"abuse_bench [{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cpu = cpu_info()
    token = secrets.token_urlsafe(24)
    os.environ[CLUSTER_TOKEN_ENV] = token  # the launcher hands it to every child
    os.environ.pop(API_KEY_ENV, None)  # an open cluster: the attacker needs no key
    os.environ["OMP_NUM_THREADS"] = "1"
    log_dir = Path(tempfile.mkdtemp(prefix="abuse-bench-logs-"))  # kept: the children's logs
    attacks = make_attacks()
    with tempfile.TemporaryDirectory(prefix="abuse-bench-model-") as tmp:
        model_dir = Path(args.model) if args.model else Path(tmp) / "model"
        if not args.model:
            make_tiny_model(model_dir)
        _say(f"model {args.model or 'tiny qwen3'}, logs in {log_dir}")
        modes = {mode: run_mode(mode, model_dir, args, log_dir, token, attacks)
                 for mode in args.modes.split(",")}  # fmt: skip
        _say("limited: one instance under RLIMIT_AS 3.5 GB")
        limited = run_limited(model_dir, log_dir)
    cpu["loadavg_1m_end"] = os.getloadavg()[0]
    config = {"model": args.model or "tiny qwen3 (" + " ".join(TINY_MODEL_ARGS) + ")",
              "modes": args.modes.split(","), "repeats": args.repeats, "quiet_s": args.quiet_s,
              "tail_s": TAIL_S, "victim_max_tokens": args.victim_max_tokens,
              "health_every_s": HEALTH_EVERY_S, "serve_args": list(_SERVE_ARGS),
              "threads_per_instance": 1, "transport": "tcp"}  # fmt: skip
    command = shlex.join(["python", "benchmarks/abuse_bench.py", *sys.argv[1:]])
    return {"command": command, "cpu": cpu, "config": config, "modes": modes, "limited": limited}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a model dir (default: a tiny random one)")
    parser.add_argument("--modes", default="pull,push", help="comma list of pull, push")
    parser.add_argument("--repeats", type=int, default=5, help="sends per size/stop attack")
    parser.add_argument("--quiet-s", type=float, default=3.0, help="baseline window per attack")
    parser.add_argument("--victim-max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "abuse.json")
    args = parser.parse_args(argv)
    if set(args.modes.split(",")) - {"pull", "push"}:
        parser.error(f"--modes takes pull and push, got {args.modes!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: children are stopped
    started = time.monotonic()
    doc = run(args)
    doc["config"]["wall_s"] = round(time.monotonic() - started, 1)
    doc["failures"] = failures(doc)
    print_table(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
