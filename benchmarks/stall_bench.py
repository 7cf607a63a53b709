"""How long a KV handoff stalls the decodes already running on the decode instance (D).

In vLLM-style pull, D builds the transfer descriptors and posts the READ inline on its engine
loop, so every running decode on D waits; push, and pull with `--pull-setup background`, do
that work off the loop. Per mode (a fresh local cluster each time: 1 prefill + 1 decode, or
one aggregated instance, one torch thread each), this starts `--num-running` greedy streams
with short prompts and long outputs, waits until they all decode, then sends `--num-new`
requests of `--prompt-len` fresh random token ids `--gap-s` apart. It reports:
- loop_blocked_ms: D's `disagg_kv_loop_blocked_seconds` (_sum/_count delta over the new
  requests) per handoff, and each new request's `loop_blocked_s` from its breakdown;
- the running streams' inter-token latency (client arrival times) while the new requests are
  in flight: p50, p99, max and TPOT, against their ITL outside that window (baseline);
- the new requests' TTFT.
Expected: pull-inline blocks D's loop for the descriptor prep + post (with UCX over CMA the
copy itself runs inside the post: ~20 ms for 2048 tokens of SmolLM2-135M); pull-background and
push for well under a millisecond; aggregated stalls for each new prompt's whole prefill
(seconds on one CPU thread). Caveat: with fewer cores than busy processes (P, D, router, this
client), P's prefill slows D during the window in every disaggregated mode, and that noise can
hide a tens-of-ms stall in the ITL columns; loop_blocked_ms is the direct measure.
Modes are interleaved across repeats; the table shows medians over repeats. Prints a table; the
last stdout line is the JSON document (also written to --out).

    python benchmarks/stall_bench.py [--modes pull-inline,push] [--repeats 2] [--out FILE]

`--experiment late-binding` runs benchmarks/late_binding_bench.py instead (1 prefill + 2 decode
instances, least_loaded: where choosing D after prefill pays); the other flags are its own.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

# benchmarks/ is on sys.path when this file runs as a script.
import late_binding_bench
from live_cluster import (
    BLOCK_SIZE,
    CLIENT_TIMEOUT,
    MODES,
    format_cell,
    loop_blocked,
    provenance,
    stream,
    to_ms,
    vocab_size,
    write_result,
)

from disagg.cluster.config import ClusterConfig
from disagg.cluster.launcher import Cluster

_STEADY_PROMPT = "Write a long story about a lighthouse keeper named {i} who finds a map in a "
_STEADY_PROMPT += "bottle, and tell every detail of the journey that follows, chapter by chapter."


def serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """A context and block pool that hold the running streams and every new prompt at once."""
    steady_tokens = 64 + args.steady_max_tokens  # the prompt is < 64 tokens
    max_len = max(steady_tokens, args.prompt_len + 4)
    total = args.num_running * steady_tokens + (args.num_new + 1) * (args.prompt_len + 4)
    num_blocks = max(math.ceil(total / BLOCK_SIZE) + 64, math.ceil(max_len / BLOCK_SIZE))
    return ("--max-model-len", str(max_len), "--num-blocks", str(num_blocks),
            "--max-num-batched-tokens", str(args.batched_tokens))  # fmt: skip


# ---- HTTP --------------------------------------------------------------------------------------


async def new_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int]
) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    times: list[float] = []
    sent = time.perf_counter()
    breakdown = await stream(session, url, body, times)
    if not times:
        raise RuntimeError("a new request returned no token")
    return {"ttft_s": times[0] - sent, "loop_blocked_s": breakdown.get("loop_blocked_s"),
            "handoff_setup_s": breakdown.get("handoff_setup_s"),
            "transfer_s": breakdown.get("transfer_s")}  # fmt: skip


# ---- one measurement -----------------------------------------------------------------------


async def _wait_for_tokens(
    streams: list[list[float]], tasks: list[asyncio.Task[Any]], more: int
) -> None:
    """Until every running stream has `more` tokens beyond what it has now."""
    targets = [len(times) + more for times in streams]
    while any(len(times) < n for times, n in zip(streams, targets, strict=True)):
        for task in tasks:
            if task.done():
                task.result()  # raises its error; a clean end this early is one too
                raise RuntimeError("a running stream ended early: raise --steady-max-tokens")
        await asyncio.sleep(0.01)


async def measure(
    url: str, decode_url: str, args: argparse.Namespace, rng: random.Random, vocab: int
) -> dict[str, Any]:
    """Steady streams, then the new requests; -> raw numbers of this run."""

    def prompt() -> list[int]:
        return [rng.randrange(100, min(40000, vocab)) for _ in range(args.prompt_len)]

    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, trust_env=False) as session:
        await new_request(session, url, prompt()[:64])  # first contact: handshake, wire-up
        await new_request(session, url, prompt())  # first long prefill and transfer
        streams: list[list[float]] = [[] for _ in range(args.num_running)]
        body = {"max_tokens": args.steady_max_tokens, "temperature": 0, "ignore_eos": True}
        tasks = [
            asyncio.create_task(
                stream(session, url, {**body, "prompt": _STEADY_PROMPT.format(i=i)}, times)
            )  # fmt: skip
            for i, times in enumerate(streams)
        ]
        try:
            await _wait_for_tokens(streams, tasks, 2)
            settled = time.perf_counter()
            await asyncio.sleep(args.baseline_s)
            before = await loop_blocked(session, decode_url)
            start = time.perf_counter()
            sends = []
            for i in range(args.num_new):
                sends.append(asyncio.create_task(new_request(session, url, prompt())))
                if i + 1 < args.num_new:
                    await asyncio.sleep(args.gap_s)
            new = await asyncio.gather(*sends)
            end = time.perf_counter()
            after = await loop_blocked(session, decode_url)
            await _wait_for_tokens(streams, tasks, 4)  # still running: tokens after the window
            await asyncio.sleep(args.baseline_s)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return summarize(streams, settled, start, end, new, before, after)


def summarize(
    streams: list[list[float]],
    settled: float,
    start: float,
    end: float,
    new: list[dict[str, Any]],
    before: tuple[float, float],
    after: tuple[float, float],
) -> dict[str, Any]:
    inside, outside, tpots = [], [], []
    for times in streams:
        for a, b in zip(times, times[1:], strict=False):
            if b >= start and a <= end:  # this gap overlaps the window
                inside.append(b - a)
            elif a >= settled:
                outside.append(b - a)
        in_window = [t for t in times if start <= t <= end]
        if len(in_window) >= 2:
            tpots.append((in_window[-1] - in_window[0]) / (len(in_window) - 1))
    handoffs = after[1] - before[1]
    blocked = [r["loop_blocked_s"] for r in new if r["loop_blocked_s"] is not None]
    return {
        "loop_blocked_ms_per_handoff": to_ms((after[0] - before[0]) / handoffs)
        if handoffs
        else None,
        "num_handoffs": int(handoffs),
        "loop_blocked_ms_each": [to_ms(b) for b in blocked],
        "itl_p50_ms": to_ms(_pct(inside, 50)),
        "itl_p99_ms": to_ms(_pct(inside, 99)),
        "itl_max_ms": to_ms(max(inside, default=None)),
        "tpot_ms": to_ms(statistics.mean(tpots) if tpots else None),
        "baseline_itl_p50_ms": to_ms(_pct(outside, 50)),
        "baseline_itl_max_ms": to_ms(max(outside, default=None)),
        "new_ttft_ms": to_ms(statistics.median(r["ttft_s"] for r in new)),
        "new_ttft_ms_each": [to_ms(r["ttft_s"]) for r in new],
        "new_setup_ms_each": [to_ms(r["handoff_setup_s"]) for r in new],
        "new_transfer_ms_each": [to_ms(r["transfer_s"]) for r in new],
        "window_s": round(end - start, 3),
        "num_itl_window": len(inside),
        "num_itl_baseline": len(outside),
    }


def _pct(values: list[float], q: float) -> float | None:
    """Percentile with linear interpolation between closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# ---- the run -------------------------------------------------------------------------------

_COLUMNS = ("loop_blocked_ms_per_handoff", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "tpot_ms",
            "baseline_itl_p50_ms", "new_ttft_ms")  # fmt: skip
_HEADERS = ("blocked_ms/handoff", "itl_p50", "itl_p99", "itl_max", "tpot", "base_p50", "ttft")


def run_one(mode: str, args: argparse.Namespace, repeat: int, log_dir: Path, vocab: int) -> dict:
    config = ClusterConfig(model=args.model, kv_transport=args.transport,
                           serve_args=serve_args(args), log_dir=log_dir / f"{mode}-{repeat}",
                           **MODES[mode])  # fmt: skip
    print(f"stall_bench: {mode}, repeat {repeat + 1}/{args.repeats}", file=sys.stderr)
    with Cluster(config) as cluster:
        urls = cluster.instance_urls
        decode_url = (urls.get("decode") or urls["both"])[0]
        rng = random.Random(f"stall-{mode}-{repeat}")
        raw = asyncio.run(measure(cluster.url, decode_url, args, rng, vocab))
    return {"mode": mode, "repeat": repeat, **raw}


def medians(runs: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        row: dict[str, Any] = {"mode": mode, "repeats": len(mine)}
        for key in _COLUMNS:
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = round(statistics.median(values), 3) if values else None
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], ratio: float | None) -> None:
    widths = [19] + [10] * (len(_COLUMNS) - 1)
    print(f"{'mode':>16}" + "".join(f"{h:>{w}}" for h, w in zip(_HEADERS, widths, strict=True)))
    for row in rows:
        cells = [format_cell(row[k], w) for k, w in zip(_COLUMNS, widths, strict=True)]
        print(f"{row['mode']:>16}" + "".join(cells))
    print("ms; itl_* / tpot: running streams while the new requests were in flight; base_p50:")
    print("their ITL outside that window; ttft: the new requests' (median over repeats).")
    if ratio is not None:
        print(
            f"loop blocked per handoff, pull-background / pull-inline: {ratio:.2%} (target: <= 5%)"
        )


def _ratio(rows: list[dict[str, Any]]) -> float | None:
    by_mode = {row["mode"]: row["loop_blocked_ms_per_handoff"] for row in rows}
    inline, background = by_mode.get("pull-inline"), by_mode.get("pull-background")
    return background / inline if inline and background is not None else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--experiment", choices=_EXPERIMENTS, default="stall",
        help="late-binding: benchmarks/late_binding_bench.py, with its own flags")  # fmt: skip
    add("--model", default="smollm2-135m", help="short name or model directory")
    add("--repeats", type=int, default=2)
    add("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    add("--prompt-len", type=int, default=2048, help="tokens per new request")
    add("--num-new", type=int, default=3, help="new requests per run")
    add("--num-running", type=int, default=4, help="streams decoding on D meanwhile")
    add("--gap-s", type=float, default=1.5, help="between the new requests' sends")
    add("--baseline-s", type=float, default=2.0, help="ITL baseline before and after the window")
    add("--steady-max-tokens", type=int, default=2048, help="max_tokens of the running streams")
    add("--batched-tokens", type=int, default=2048, help="--max-num-batched-tokens per step")
    add("--transport", default="nixl", choices=("nixl", "tcp"))
    add("--out", type=Path, default=Path("docs/results/stall_bench.json"))
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {list(MODES)}")
    return args


_EXPERIMENTS = ("stall", "late-binding")


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--experiment", choices=_EXPERIMENTS, default="stall")
    experiment, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if experiment.experiment == "late-binding":
        return late_binding_bench.main(rest)
    args = parse_args(argv)
    modes = args.modes.split(",")
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    vocab = vocab_size(args.model)
    runs = []
    with tempfile.TemporaryDirectory(prefix="stall-bench-") as tmp:
        for repeat in range(args.repeats):
            runs += [run_one(mode, args, repeat, Path(tmp), vocab) for mode in modes]
    rows = medians(runs, modes)
    ratio = _ratio(rows)
    config = {key: getattr(args, key) for key in ("model", "repeats", "prompt_len", "num_new",
              "num_running", "gap_s", "baseline_s", "steady_max_tokens", "transport")}  # fmt: skip
    config |= {"modes": modes, "serve_args": list(serve_args(args)), "threads_per_instance": 1}
    config |= provenance(started, load_start)
    result = {"config": config, "results": rows, "background_vs_inline": ratio, "runs": runs}
    print_table(rows, ratio)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
