"""Time the serving path around the engine as it is deployed: the router and an instance as
separate processes (the project's own `disagg up`, one torch thread each), the project's bench
client, one streamed request at a time, and a 1-layer checkpoint whose steps are short.

Two figures come out, each the served time minus the engine's own:
- **hop**: (TTFT - the instance's own queue and prefill stages) / 2. The simulator charges a
  hop for a leg going out and one for its answer coming back; what it covers here is the
  client's send, the router's parse and relay, the instance's parse, the engine thread's
  wake-up, the first token's detokenize and SSE event, and the way back.
- **per output token**: median ITL - the same checkpoint's decode `Engine.step` timed in a
  fresh process, as the instance is (the calibrating process may be a long-lived one, such as a
  test run, whose steps are slower). The engine's thread hands each token to the event loop,
  which detokenizes it and writes an SSE event that the router relays; in one interpreter that
  work and the engine loop take turns, so the simulator adds it to a step per sampled token.

The same runs give what the serving path costs the host's cores (co-location, host_cpu.py):
the CPU-seconds of the router, the client and the instance outside its `engine-loop` thread,
read from /proc before and after two runs that differ only in output length (33 and 2
tokens), solved for a cost per streamed token and per request.

A micro-measurement of the path (a model with almost no compute), not of any workload: it
never looks at a sweep.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from disagg.bench.thread_cpu import thread_cpu_seconds

__all__ = ["ServingFit", "measure_serving"]

_PROMPT_LEN = 256
_OUTPUT_LEN = 33  # 32 inter-token gaps per request
_SHORT_OUTPUT_LEN = 2  # the second run: what a request costs apart from its tokens
_WARMUP = 3
_TOKEN_RANGE = (100, 4000)


@dataclass(frozen=True, slots=True)
class ServingFit:
    hop_s: float
    output_token_s: float
    num_requests: int
    ttft_outside_stages_s: float  # median TTFT minus the instance's queue + prefill stages
    itl_s: float  # median inter-token latency served
    step_s: float  # median decode Engine.step of the same checkpoint, in-process
    # Co-location: CPU-seconds outside the engine threads (router + client + instance loop)
    token_cpu_s: float = 0.0  # per streamed token
    request_cpu_s: float = 0.0  # per request
    loop_request_cpu_s: float = 0.0  # per request, the instance's own event loop alone
    num_cores: int = 1  # the cores this process may run on


@dataclass(frozen=True, slots=True)
class _CpuSpent:
    """CPU-seconds one run cost outside the engine threads."""

    num_requests: int
    num_tokens_each: int
    serving_s: float  # router + client + instance outside its engine-loop thread
    loop_s: float  # the instance outside its engine-loop thread


def _cpu_s(pid: int) -> tuple[float, float]:
    """(the whole process, its `engine-loop` thread) CPU-seconds so far, from /proc."""
    threads = thread_cpu_seconds(pid).values()
    return sum(s for _, s in threads), sum(s for name, s in threads if name == "engine-loop")


def _tiny_checkpoint(root: Path) -> Path:
    from disagg.engine.make_model import write_checkpoint

    return write_checkpoint(
        root / "serving-path",
        num_layers=1,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=4096,
    )


def _decode_step_s(model_dir: Path) -> float:
    """Median decode `Engine.step` of one request, in this process, one torch thread."""
    import torch

    from disagg.config import EngineConfig
    from disagg.engine.engine import Engine
    from disagg.protocol import SamplingParams

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_threads=1), model_dir)
    times: list[float] = []
    for i in range(6):
        prompt = list(range(_TOKEN_RANGE[0] + i, _TOKEN_RANGE[0] + i + _PROMPT_LEN))
        sampling = SamplingParams(max_tokens=_OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        engine.add_request(f"s{i}", prompt, sampling)
        steps = []
        while engine.has_work:
            started = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - started)
        if i >= 2:  # the first requests warm the allocator and the kernels
            times += steps[1:]  # decode steps only
    return statistics.median(times)


def _decode_step_s_in_fresh_process(model_dir: Path) -> float:
    argv = [sys.executable, "-m", "disagg.sim.measure_serving", str(model_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    return float(done.stdout.split()[-1])


def _served(model_dir: Path, num_requests: int) -> tuple[dict, list[_CpuSpent]]:
    """The streamed run (33 tokens each) and the CPU both runs (33, then 2 tokens) spent."""
    from disagg.bench.runner import BenchConfig, run_benchmark
    from disagg.bench.workload import WorkloadConfig
    from disagg.cluster.config import ClusterConfig
    from disagg.cluster.launcher import Cluster

    config = ClusterConfig(
        mode="aggregated",
        num_decode=1,
        model=str(model_dir),
        port=0,
        threads_per_instance=1,
        serve_args=("--dtype", "float32"),
    )
    spent: list[_CpuSpent] = []
    with Cluster(config) as cluster:
        router, instance = cluster.pids["router"], cluster.pids["both-0"]
        for output_len, warmup in ((_OUTPUT_LEN, _WARMUP), (_SHORT_OUTPUT_LEN, 0)):
            workload = WorkloadConfig(
                num_prompts=num_requests, input_len=_PROMPT_LEN, output_len=output_len,
                token_range=_TOKEN_RANGE, seed=7,
            )  # fmt: skip
            bench = BenchConfig(base_url=cluster.url, workload=workload, max_concurrency=1,
                                warmup=warmup)  # fmt: skip
            before = (_cpu_s(router)[0], *_cpu_s(instance), time.process_time())
            result = asyncio.run(run_benchmark(bench))
            after = (_cpu_s(router)[0], *_cpu_s(instance), time.process_time())
            d_router, d_inst, d_engine, d_client = (
                b - a for a, b in zip(before, after, strict=True)
            )
            loop_s = d_inst - d_engine
            spent.append(_CpuSpent(num_requests + warmup, output_len,
                                   d_router + d_client + loop_s, loop_s))  # fmt: skip
            if output_len == _OUTPUT_LEN:
                streamed = result
    return streamed, spent


def _per_token_and_request(a: float, b: float, runs: list[_CpuSpent]) -> tuple[float, float]:
    """(per token, per request) CPU-seconds from the two runs' totals `a` (long outputs) and
    `b` (short): each run's total is requests x (per request + tokens each x per token)."""
    long, short = runs
    per_long, per_short = a / long.num_requests, b / short.num_requests
    per_token = max(0.0, (per_long - per_short) / (long.num_tokens_each - short.num_tokens_each))
    return per_token, max(0.0, per_short - per_token * short.num_tokens_each)


def measure_serving(num_requests: int = 30) -> ServingFit:
    with tempfile.TemporaryDirectory(prefix="disagg-serving-") as root:
        model_dir = _tiny_checkpoint(Path(root))
        result, spent = _served(model_dir, num_requests)
        step_s = _decode_step_s_in_fresh_process(model_dir)
    outside = [
        ttft - b.get("queue_s", 0.0) - b.get("prefill_s", 0.0)
        for ttft, b in zip(result["ttfts"], result["breakdowns"], strict=True)
        if ttft and b
    ]
    if not outside:
        raise RuntimeError(f"no request succeeded: {result.get('errors', [])[:3]}")
    ttft_outside_s = statistics.median(outside)
    itl_s = result["median_itl_ms"] / 1e3
    token_cpu_s, request_cpu_s = _per_token_and_request(
        spent[0].serving_s, spent[1].serving_s, spent
    )
    _, loop_request_cpu_s = _per_token_and_request(spent[0].loop_s, spent[1].loop_s, spent)
    return ServingFit(
        hop_s=ttft_outside_s / 2,
        output_token_s=max(0.0, itl_s - step_s),
        num_requests=len(outside),
        ttft_outside_stages_s=ttft_outside_s,
        itl_s=itl_s,
        step_s=step_s,
        token_cpu_s=token_cpu_s,
        request_cpu_s=request_cpu_s,
        loop_request_cpu_s=loop_request_cpu_s,
        num_cores=len(os.sched_getaffinity(0)),
    )


if __name__ == "__main__":  # the step timing, in a process of its own
    print(_decode_step_s(Path(sys.argv[1])))
