"""The benchmark against a live aggregated `disagg serve` (a real engine in its own process):
exact output lengths, every request completed, and the server's TTFT breakdown collected."""

from __future__ import annotations

import asyncio
import math

import pytest

from disagg.bench.runner import BenchConfig, run_benchmark
from disagg.bench.workload import WorkloadConfig
from tests.e2e.cluster import Cluster, Proc


@pytest.fixture(scope="module")
def server(cluster: Cluster) -> Proc:
    proc = cluster.serve("aggregated")
    cluster.wait_ready(proc)
    return proc


@pytest.mark.parametrize("dataset", ["random", "prefix"])
def test_bench_against_live_server(server: Proc, dataset: str) -> None:
    workload = WorkloadConfig(
        dataset=dataset, num_prompts=6, input_len=24, output_len=5, prefix_len=32, seed=3
    )
    cfg = BenchConfig(base_url=server.url, workload=workload, request_rate=20.0, warmup=1)
    result = asyncio.run(run_benchmark(cfg))
    assert result["completed"] == 6 and not any(result["errors"])
    assert result["output_lens"] == [5] * 6  # ignore_eos + max_tokens: exact
    expected_input = 24 if dataset == "random" else 32 + 24
    assert result["input_lens"] == [expected_input] * 6
    # Timings under whatever else loads the machine: measured and ordered, never sized. A busy
    # client can read a request's last tokens in one go, so TPOT may be 0 and E2EL = TTFT.
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert math.isfinite(result["mean_tpot_ms"]) and result["mean_tpot_ms"] >= 0
    assert result["output_throughput"] > 0
    breakdown = result["mean_breakdown_ms"]
    assert breakdown["prefill"] > 0 and "queue" in breakdown
