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

A micro-measurement of the path (a model with almost no compute), not of any workload: it
never looks at a sweep.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ServingFit", "measure_serving"]

_PROMPT_LEN = 256
_OUTPUT_LEN = 33  # 32 inter-token gaps per request
_TOKEN_RANGE = (100, 4000)


@dataclass(frozen=True, slots=True)
class ServingFit:
    hop_s: float
    output_token_s: float
    num_requests: int
    ttft_outside_stages_s: float  # median TTFT minus the instance's queue + prefill stages
    itl_s: float  # median inter-token latency served
    step_s: float  # median decode Engine.step of the same checkpoint, in-process


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


def _served(model_dir: Path, num_requests: int) -> dict:
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
    workload = WorkloadConfig(
        num_prompts=num_requests,
        input_len=_PROMPT_LEN,
        output_len=_OUTPUT_LEN,
        token_range=_TOKEN_RANGE,
        seed=7,
    )
    with Cluster(config) as cluster:
        bench = BenchConfig(base_url=cluster.url, workload=workload, max_concurrency=1, warmup=3)
        return asyncio.run(run_benchmark(bench))


def measure_serving(num_requests: int = 30) -> ServingFit:
    with tempfile.TemporaryDirectory(prefix="disagg-serving-") as root:
        model_dir = _tiny_checkpoint(Path(root))
        result = _served(model_dir, num_requests)
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
    return ServingFit(
        hop_s=ttft_outside_s / 2,
        output_token_s=max(0.0, itl_s - step_s),
        num_requests=len(outside),
        ttft_outside_stages_s=ttft_outside_s,
        itl_s=itl_s,
        step_s=step_s,
    )


if __name__ == "__main__":  # the step timing, in a process of its own
    print(_decode_step_s(Path(sys.argv[1])))
