"""Where late binding pays: a decode instance (D) turns busy while a new prompt is prefilling.

Cluster per run: 1 prefill (P) + 2 decode instances behind a `least_loaded` router (it reads
every instance's /load: running, waiting, free blocks, queued prefill tokens), one torch thread
each. Push binds early: the router picks D when the request arrives and sends both legs at once.
Pull binds late: the router picks D after P's prefill, from /load read at that moment.

Per new request (one at a time, `--num-new` per run):
1. wait until all instances are idle and the router has polled /load since (so both D look
   exactly alike: same running, waiting and free blocks; least_loaded breaks the tie by rotation);
2. send it through the router: `--prompt-len` fresh random token ids, `--max-tokens` outputs;
3. `--burst-delay-s` later (P is still prefilling; push has already bound its D) start
   `--burst-size` streams with 8-token prompts and long outputs directly at one D's own URL (a
   plain request there is computed locally, prefill instant), so that D decodes a batch of
   `--burst-size` while the new request's prefill finishes, and while it decodes;
4. once the new request is done, cancel the burst (the client disconnect aborts it on D).
Which D gets the burst is drawn at random, independent of the router: a balanced shuffle per
repeat, the same draw for every mode. An adversary that always bursts the D push picked would
make push lose every time, which no real arrival process does; the independent draw is what
unrelated traffic does, so push is expected to land on the busy D about half the time and pull
(which sees the burst in /load) almost never. Since least_loaded breaks push's ties by rotation
(D0, D1, D0, ...), push's fraction is set by the draw (`--seed`; seed 0 gives 4 of 6 per
repeat): read tpot_busy / tpot_idle for the cost of one wrong pick. Which D served a request:
the one whose `disagg_kv_loop_blocked_seconds_count` (one observation per handoff) went up.

Reported per mode (pooled over repeats; modes interleaved): the new requests' median TTFT and
TPOT (from client arrival times; TPOT depends on how many streams share that D's steps), the
fraction that landed on the busy D, and TPOT split by busy/idle D. Caveat: on a 2-core machine
the busy D, P's prefill and the other D share the cores, so "idle" is not free of contention.
Prints a table; the last stdout line is the JSON document (also written to --out).

    python benchmarks/late_binding_bench.py [--modes push,pull-background] [--repeats 2]
    python benchmarks/stall_bench.py --experiment late-binding [same flags]
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
from live_cluster import (
    BLOCK_SIZE,
    CLIENT_TIMEOUT,
    MODES,
    format_cell,
    provenance,
    stream,
    to_ms,
    vocab_size,
    write_result,
)
from live_cluster import loop_blocked as handoff_counter

from disagg.cluster.config import ClusterConfig
from disagg.cluster.launcher import Cluster

LB_MODES = ("push", "pull-background", "pull-inline")
_SETTLE_S = 0.3  # after all instances are idle: the router polls /load every 50 ms
_IDLE_TIMEOUT_S = 120.0


def serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Context and blocks for a whole burst (to its max_tokens) plus two new prompts."""
    burst_tokens = 8 + args.burst_max_tokens
    new_tokens = args.prompt_len + args.max_tokens
    max_len = max(burst_tokens, new_tokens) + 4
    burst_blocks = args.burst_size * math.ceil(burst_tokens / BLOCK_SIZE)
    blocks = burst_blocks + 2 * math.ceil(new_tokens / BLOCK_SIZE)
    return ("--max-model-len", str(max_len), "--num-blocks", str(blocks + 64),
            "--max-num-batched-tokens", str(args.batched_tokens))  # fmt: skip


# ---- HTTP helpers --------------------------------------------------------------------------


async def get_load(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with session.get(f"{url}/load") as resp:
        return await resp.json()


async def wait_idle(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """Until no instance runs or queues anything, then long enough for the router to see it."""
    deadline = time.monotonic() + _IDLE_TIMEOUT_S
    while True:
        loads = await asyncio.gather(*(get_load(session, url) for url in urls))
        if all(load["num_running"] == 0 and load["num_waiting"] == 0 for load in loads):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"instances still busy after {_IDLE_TIMEOUT_S} s: {loads}")
        await asyncio.sleep(0.05)
    await asyncio.sleep(_SETTLE_S)


async def handoffs(session: aiohttp.ClientSession, decode_urls: list[str]) -> list[int]:
    """Per D: handoffs finished so far."""
    pairs = await asyncio.gather(*(handoff_counter(session, url) for url in decode_urls))
    return [int(count) for _, count in pairs]


async def served_by(
    session: aiohttp.ClientSession, decode_urls: list[str], before: list[int]
) -> int | None:
    """Index of the D whose handoff count rose by one (a request's metrics land at its end)."""
    for _ in range(40):
        after = await handoffs(session, decode_urls)
        deltas = [a - b for a, b in zip(after, before, strict=True)]
        if sorted(deltas) == [0] * (len(deltas) - 1) + [1]:
            return deltas.index(1)
        await asyncio.sleep(0.05)
    return None


async def timed(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> dict[str, float]:
    """One greedy streamed request of exactly `max_tokens` outputs (ignore_eos).

    -> send time, first text chunk, end of stream ([DONE]) and the number of text chunks (a
    step whose text is held back, e.g. half a UTF-8 character, sends no chunk)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    sent = time.perf_counter()
    times: list[float] = []
    await stream(session, url, body, times)
    if not times:
        raise RuntimeError("a new request returned no token")
    return {"sent": sent, "first": times[0], "done": time.perf_counter(), "chunks": len(times)}


# ---- one run -------------------------------------------------------------------------------


async def measure(
    url: str, prefill_url: str, decode_urls: list[str], args: argparse.Namespace,
    rng: random.Random, targets: list[int], vocab: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Warm both D up, then the new requests, each with its burst; -> one record per request."""
    all_urls = [prefill_url, *decode_urls]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, min(40000, vocab)) for _ in range(n)]

    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, trust_env=False) as session:
        for _ in range(8):  # first contact of each D with P: handshake, wire-up
            if min(await handoffs(session, decode_urls)) > 0:
                break
            await timed(session, url, prompt(64), 2)
            await wait_idle(session, all_urls)
        else:
            raise RuntimeError("the router never used one of the decode instances")
        await timed(session, url, prompt(args.prompt_len), 2)  # first long prefill
        records = []
        for target in targets:
            await wait_idle(session, all_urls)
            before = await handoffs(session, decode_urls)
            new = asyncio.create_task(timed(session, url, prompt(args.prompt_len), args.max_tokens))
            await asyncio.sleep(args.burst_delay_s)
            burst_times: list[list[float]] = [[] for _ in range(args.burst_size)]
            body = {"max_tokens": args.burst_max_tokens, "temperature": 0, "ignore_eos": True}
            burst = [
                asyncio.create_task(stream(session, decode_urls[target],
                                           {**body, "prompt": prompt(8)}, times))
                for times in burst_times
            ]  # fmt: skip
            try:
                times = await new
                outlasted = not any(task.done() for task in burst)
                for task in burst:
                    if task.done():
                        task.result()  # an error in the burst is the run's error
            finally:
                for task in burst:
                    task.cancel()
                await asyncio.gather(*burst, return_exceptions=True)
            await wait_idle(session, all_urls)
            index = await served_by(session, decode_urls, before)
            first, done = times["first"], times["done"]
            records.append({
                "ttft_ms": to_ms(first - times["sent"]),
                "tpot_ms": to_ms((done - first) / (args.max_tokens - 1)),
                "num_chunks": times["chunks"], "burst_target": target, "served_by": index,
                "on_busy": None if index is None else index == target,
                "burst_outlasted": outlasted,
                "burst_tokens_while_decoding": sum(first <= t <= done for b in burst_times
                                                   for t in b),
            })  # fmt: skip
    return records


def run_one(mode: str, args: argparse.Namespace, repeat: int, log_dir: Path, vocab: int) -> dict:
    config = ClusterConfig(model=args.model, kv_transport=args.transport, num_decode=2,
                           policy="least_loaded", serve_args=serve_args(args),
                           log_dir=log_dir / f"{mode}-{repeat}", **MODES[mode])  # fmt: skip
    print(f"late_binding_bench: {mode}, repeat {repeat + 1}/{args.repeats}", file=sys.stderr)
    # The same prompts and burst targets for every mode of one repeat.
    targets = [i % 2 for i in range(args.num_new)]
    random.Random(f"targets-{args.seed}-{repeat}").shuffle(targets)
    rng = random.Random(f"prompts-{args.seed}-{repeat}")
    with Cluster(config) as cluster:
        urls = cluster.instance_urls
        records = asyncio.run(measure(cluster.url, urls["prefill"][0], urls["decode"], args,
                                      rng, targets, vocab))  # fmt: skip
    return {"mode": mode, "repeat": repeat, "requests": records}


# ---- summary -------------------------------------------------------------------------------

_COLUMNS = ("num_new", "ttft_p50_ms", "tpot_p50_ms", "tpot_mean_ms", "on_busy_fraction",
            "tpot_p50_busy_ms", "tpot_p50_idle_ms")  # fmt: skip
_HEADERS = ("n", "ttft_p50", "tpot_p50", "tpot_mean", "on_busy", "tpot_busy", "tpot_idle")


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        mine = [r for run in runs if run["mode"] == mode for r in run["requests"]]
        known = [r for r in mine if r["on_busy"] is not None]
        busy = [r["tpot_ms"] for r in known if r["on_busy"]]
        idle = [r["tpot_ms"] for r in known if not r["on_busy"]]
        tpots = [r["tpot_ms"] for r in mine]
        rows.append({
            "mode": mode, "num_new": len(mine),
            "ttft_p50_ms": _median([r["ttft_ms"] for r in mine]),
            "tpot_p50_ms": _median(tpots),
            "tpot_mean_ms": round(statistics.mean(tpots), 3),
            "on_busy_fraction": round(len(busy) / len(known), 3) if known else None,
            "tpot_p50_busy_ms": _median(busy), "tpot_p50_idle_ms": _median(idle),
            "num_unknown_decode": len(mine) - len(known),
            "num_burst_ended_early": sum(not r["burst_outlasted"] for r in mine),
        })  # fmt: skip
    return rows


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'mode':>16}" + "".join(f"{h:>11}" for h in _HEADERS))
    for row in rows:
        cells = [f"{row['num_new']:>11}"] + [format_cell(row[k], 11) for k in _COLUMNS[1:]]
        print(f"{row['mode']:>16}" + "".join(cells))
    print("ms, pooled over repeats; on_busy: fraction of new requests decoded on the D that got")
    print("the burst; tpot_busy / tpot_idle: median TPOT of those on the busy / the other D.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="short name or model directory")
    add("--repeats", type=int, default=2)
    add("--modes", default=",".join(LB_MODES), help=f"comma list of {', '.join(LB_MODES)}")
    add("--prompt-len", type=int, default=1024, help="tokens per new request")
    add("--max-tokens", type=int, default=32, help="outputs per new request")
    add("--num-new", type=int, default=6, help="new requests per run (one at a time)")
    add("--burst-size", type=int, default=16, help="streams sent to one D per new request")
    add("--burst-max-tokens", type=int, default=512, help="max_tokens of a burst stream")
    add("--burst-delay-s", type=float, default=0.5, help="from a new request's send to its burst")
    add("--batched-tokens", type=int, default=2048, help="--max-num-batched-tokens per step")
    add("--transport", default="nixl", choices=("nixl", "tcp"))
    add("--seed", type=int, default=0, help="prompts and burst targets")
    add("--out", type=Path, default=Path("docs/results/late_binding.json"))
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(LB_MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {list(LB_MODES)}")
    if args.num_new < 1 or args.burst_size < 1 or args.max_tokens < 2:
        parser.error("--num-new and --burst-size must be >= 1, --max-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = args.modes.split(",")
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    vocab = vocab_size(args.model)
    runs = []
    with tempfile.TemporaryDirectory(prefix="late-binding-bench-") as tmp:
        for repeat in range(args.repeats):
            runs += [run_one(mode, args, repeat, Path(tmp), vocab) for mode in modes]
    rows = summarize(runs, modes)
    config = {key: getattr(args, key) for key in ("model", "repeats", "prompt_len", "max_tokens",
              "num_new", "burst_size", "burst_max_tokens", "burst_delay_s", "transport",
              "seed")}  # fmt: skip
    config |= {"modes": modes, "num_prefill": 1, "num_decode": 2, "policy": "least_loaded"}
    config |= {"serve_args": list(serve_args(args)), "threads_per_instance": 1}
    config |= provenance(started, load_start)
    result = {"config": config, "results": rows, "runs": runs}
    print_table(rows)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
