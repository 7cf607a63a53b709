"""Our router in front of vLLM's push connector, checked for real: vLLM prefill and decode instances
with `NixlPushConnector`, a third vLLM instance without a connector (aggregated), and `disagg
route --mode push` in front of the pair, telling the instances' engine from what they answer
and P's NIXL identity from its /server_info (P runs with VLLM_SERVER_DEV_MODE=1).

1. Correctness: 16 greedy requests sent at once through the router, and the same 16 at once
   to the aggregated instance: the texts must be identical.
2. A decode instance killed mid-stream: 8 streams through the router each get their first
   tokens, D is SIGKILLed; every client must be answered (its stream ended, with an error
   event) within 30 s, and requests sent after the kill are refused quickly. Then P's /metrics
   must come back to no KV in use and no request held (P's leases end within vLLM's 30 s
   lease), its expired-lease counter reported.

Writes docs/results/vllm_push_router.json; the last stdout line is the JSON. Exits 1 when a
check fails. Needs vLLM (peer_pd_bench.py's docstring says how); without it, one line, exit 0.

    python benchmarks/vllm_push_check.py --vllm PEER_VENV/bin/vllm --vllm-pythonpath DIR
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from live_cluster import write_result
from peer_pd_systems import prometheus_samples, vllm_instance

from disagg.bench.host import cpu_info

HOST = "127.0.0.1"
_TOKEN = "vllm-push-check-cluster-token-0123456789"
_PROMPTS = [f"Question {i}: name one fact about the number {i * 7 + 3}. Answer:" for i in range(16)]
_CLIENT_BOUND_S = 30.0  # every client answered within this after D dies
_LEASE_BOUND_S = 90.0  # vLLM's push lease is 30 s; its expiry runs on P's engine steps


async def completions(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 32, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        doc = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {doc}")
        return doc["choices"][0]["text"]


async def check_texts(router: str, aggregated: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        ours = await asyncio.gather(*(completions(session, router, p) for p in _PROMPTS))
        theirs = await asyncio.gather(*(completions(session, aggregated, p) for p in _PROMPTS))
    same = [a == b for a, b in zip(ours, theirs, strict=True)]
    return {"requests": len(same), "identical": sum(same),
            "differing": [{"prompt": p, "router": a, "aggregated": b}
                          for p, a, b, s in zip(_PROMPTS, ours, theirs, same, strict=True)
                          if not s]}  # fmt: skip


async def _stream(session: aiohttp.ClientSession, url: str, i: int, first: asyncio.Event,
                  ended: dict[int, tuple[float, bool]]) -> None:  # fmt: skip
    """A long stream; records when it ended and whether with an error event."""
    body = {"model": "smollm2-135m", "prompt": _PROMPTS[i], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    has_error = False
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    has_error = has_error or b'"error"' in line
                    first.set()
    except aiohttp.ClientError:
        has_error = True
    ended[i] = (time.monotonic(), has_error)


async def kill_decode_mid_stream(router: str, decode_pid: int, prefill: str) -> dict[str, Any]:
    before = prometheus_samples(f"{prefill}/metrics")
    ended: dict[int, tuple[float, bool]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        firsts = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.create_task(_stream(session, router, i, firsts[i], ended))
                 for i in range(8)]  # fmt: skip
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 300)
        await asyncio.sleep(1.0)  # mid-stream
        killed_s = time.monotonic()
        os.killpg(decode_pid, signal.SIGKILL)
        after_kill = [_timed_post(session, router, p) for p in _PROMPTS[8:12]]
        late = await asyncio.gather(*after_kill)
        await asyncio.wait(tasks, timeout=_CLIENT_BOUND_S + 10)
    answered = {i: round(at - killed_s, 2) for i, (at, _) in ended.items()}
    released_s, metrics = await _wait_for_prefill_idle(prefill, killed_s)
    expired = metrics.get("vllm:nixl_num_kv_expired_reqs_total", 0.0) - before.get(
        "vllm:nixl_num_kv_expired_reqs_total", 0.0)  # fmt: skip
    return {
        "streams": 8, "answered_after_kill_s": answered,
        "streams_ended_with_error": sum(err for _, err in ended.values()),
        "sent_after_kill": [{"status": s, "seconds": t} for s, t in late],
        "prefill_idle_after_kill_s": released_s,
        "prefill_kv_cache_usage_perc": metrics.get("vllm:kv_cache_usage_perc"),
        "prefill_requests_running": metrics.get("vllm:num_requests_running"),
        "prefill_requests_waiting": metrics.get("vllm:num_requests_waiting"),
        "prefill_expired_leases": expired,
    }  # fmt: skip


async def _timed_post(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, float]:
    started_s = time.monotonic()
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 8}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, round(time.monotonic() - started_s, 2)


async def _wait_for_prefill_idle(prefill: str, since_s: float) -> tuple[float | None, dict]:
    """Seconds after `since_s` until P holds no KV and no request (None: not within the bound)."""
    metrics: dict[str, float] = {}
    while time.monotonic() - since_s < _LEASE_BOUND_S:
        metrics = prometheus_samples(f"{prefill}/metrics")
        idle = (metrics.get("vllm:kv_cache_usage_perc") == 0.0
                and metrics.get("vllm:num_requests_running") == 0.0
                and metrics.get("vllm:num_requests_waiting") == 0.0)  # fmt: skip
        if idle:
            return round(time.monotonic() - since_s, 1), metrics
        await asyncio.sleep(1.0)
    return None, metrics


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="")
    parser.add_argument("--vllm-pythonpath", default="", metavar="DIR")
    parser.add_argument("--base-port", type=int, default=23000)
    parser.add_argument("--out", type=Path, default=Path("docs/results/vllm_push_router.json"))
    args = parser.parse_args()
    if not Path(args.vllm or "-").exists():
        print("vllm_push_check: vLLM not installed (pass --vllm PATH); skipped")
        return 0
    from disagg.engine.checkpoint import resolve_model  # torch: only once we run

    model_dir, logs = str(resolve_model("smollm2-135m")), Path(tempfile.mkdtemp(prefix="vpc-"))
    base = args.base_port
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # P's identity from /server_info
    procs = [
        vllm_instance("prefill", base, "NixlPushConnector", "P", model_dir, logs / "p.log",
                      args.vllm, args.vllm_pythonpath, dev),
        vllm_instance("decode", base + 1, "NixlPushConnector", "D", model_dir, logs / "d.log",
                      args.vllm, args.vllm_pythonpath),
        vllm_instance("aggregated", base + 2, None, "A", model_dir, logs / "a.log", args.vllm,
                      args.vllm_pythonpath),
    ]  # fmt: skip
    router_argv = [sys.executable, "-m", "disagg.cli", "route", "--mode", "push", "--port",
                   str(base + 3), "--prefill", procs[0].url, "--decode", procs[1].url,
                   "--max-retries", "0"]  # fmt: skip
    router_env = {**os.environ, "DISAGG_CLUSTER_TOKEN": _TOKEN}
    router_log = (logs / "router.log").open("wb")
    router_url = f"http://{HOST}:{base + 3}"
    print(f"vllm_push_check: logs in {logs}", flush=True)
    for proc in procs:
        proc.start()
    router = subprocess.Popen(router_argv, env=router_env, stdout=router_log, stderr=router_log,
                              start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while not (_ready(router_url) and _ready(procs[2].url)):
            assert time.monotonic() < deadline, f"not ready; see {logs}"
            time.sleep(2)
        texts = asyncio.run(check_texts(router_url, procs[2].url))
        print(f"texts: {texts['identical']}/{texts['requests']} identical", flush=True)
        assert procs[1].popen is not None
        kill = asyncio.run(kill_decode_mid_stream(router_url, procs[1].popen.pid, procs[0].url))
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        for proc in procs:
            proc.stop()
    passed = {
        "texts_identical": texts["identical"] == texts["requests"],
        "every_client_within_30s": len(kill["answered_after_kill_s"]) == 8
        and max(kill["answered_after_kill_s"].values()) <= _CLIENT_BOUND_S,
        "prefill_kv_released": kill["prefill_idle_after_kill_s"] is not None,
    }  # fmt: skip
    doc = {"cpu": cpu_info(), "model": "smollm2-135m", "dtype": "float32", "texts": texts,
           "decode_killed": kill, "passed": passed}  # fmt: skip
    write_result(doc, args.out)
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
