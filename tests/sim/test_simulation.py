"""End-to-end simulations: conservation, determinism, the real scheduler, the two mechanisms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.bench.metrics import compute_metrics
from tests.sim.helpers import make_config, simulate


@pytest.mark.parametrize("mode", ["pull", "push", "aggregated"])
def test_every_request_finishes_and_every_pool_ends_full(mode: str) -> None:
    result, cluster = simulate(make_config(mode, num_prompts=10))
    assert result["completed"] == 10 and result["failed"] == 0
    assert result["output_lens"] == [16] * 10
    for instance in cluster.instances:  # run_simulation checked it too; say it here
        pool = instance.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    assert result["simulated"] is True


def test_seeded_runs_are_identical() -> None:
    a, _ = simulate(make_config("push"))
    b, _ = simulate(make_config("push"))
    assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"]


def test_the_real_scheduler_decides_the_batches() -> None:
    """A scheduler knob (the token budget) moves simulated TTFT: more chunks, more steps."""
    big, _ = simulate(make_config("aggregated", input_len=2048, max_num_batched_tokens=8192))
    small, _ = simulate(make_config("aggregated", input_len=2048, max_num_batched_tokens=256))
    assert small["mean_ttft_ms"] > 1.2 * big["mean_ttft_ms"]


def test_pull_inline_setup_stalls_decodes_push_does_not() -> None:
    kwargs = {"input_len": 4096, "output_len": 64, "num_prompts": 16, "request_rate": 6.0}
    pull, pull_cluster = simulate(make_config("pull-inline", tp=4, **kwargs))
    push, push_cluster = simulate(make_config("push", tp=4, **kwargs))
    pull_d = pull["instances"]["decode-0"]
    assert pull_d["loop_stalled_s"] > 0
    assert push["instances"]["decode-0"]["loop_stalled_s"] == 0
    # The stall shows in running decodes' token gaps and in the new request's TTFT.
    assert pull["p99_itl_ms"] > 2 * push["p99_itl_ms"]
    assert pull["mean_breakdown_ms"]["loop_blocked"] > 0
    assert push["mean_breakdown_ms"]["loop_blocked"] == 0
    assert pull["mean_ttft_ms"] > push["mean_ttft_ms"]


def test_background_pull_keeps_the_setup_off_the_decode_loop() -> None:
    """Our default pull: the same setup and transfer as inline, none of it loop time."""
    kwargs = {"input_len": 4096, "output_len": 64, "num_prompts": 16, "request_rate": 6.0}
    inline, _ = simulate(make_config("pull-inline", tp=4, **kwargs))
    background, _ = simulate(make_config("pull", tp=4, **kwargs))
    assert background["instances"]["decode-0"]["loop_stalled_s"] == 0
    assert background["mean_breakdown_ms"]["loop_blocked"] == 0
    setup = background["mean_breakdown_ms"]["handoff_setup"]
    assert setup == pytest.approx(inline["mean_breakdown_ms"]["handoff_setup"], rel=0.05)
    assert background["p99_itl_ms"] < inline["p99_itl_ms"] / 2


def test_vllm_layout_costs_more_setup_than_ours() -> None:
    vllm, _ = simulate(make_config("pull", layout="vllm"))
    ours, _ = simulate(make_config("pull", layout="ours"))
    assert vllm["mean_breakdown_counts"]["num_descriptors"] == (512 // 16) * 36 * 2
    assert ours["mean_breakdown_counts"]["num_descriptors"] <= 512 // 16
    assert vllm["mean_breakdown_ms"]["handoff_setup"] > ours["mean_breakdown_ms"]["handoff_setup"]


def test_pull_and_push_are_close_at_low_load_and_short_prompts() -> None:
    kwargs = {"input_len": 128, "request_rate": 0.5, "layout": "ours"}
    pull, _ = simulate(make_config("pull", **kwargs))
    push, _ = simulate(make_config("push", **kwargs))
    assert pull["median_ttft_ms"] == pytest.approx(push["median_ttft_ms"], rel=0.15)
    assert pull["median_tpot_ms"] == pytest.approx(push["median_tpot_ms"], rel=0.05)


def test_pull_binds_decode_late_from_live_load() -> None:
    """Two decode instances: least-loaded spreads the D legs over both."""
    _, cluster = simulate(make_config("pull", num_decode=2, num_prompts=12))
    steps = [i.num_steps for i in cluster.instances if i.role == "decode"]
    assert all(n > 0 for n in steps)


def test_result_has_every_bench_key() -> None:
    from disagg.bench.metrics import RequestResult
    from disagg.bench.runner import BenchConfig, _run_header

    bench_keys = set(_run_header(BenchConfig(base_url="http://x"), "m"))
    one = RequestResult(input_len=1, start_s=0.0, token_times_s=[1.0, 2.0], end_s=2.0)
    one.output_len = 2
    bench_keys |= set(compute_metrics([one], 2.0, (90.0, 99.0)))
    result, _ = simulate(replace(make_config("push"), goodput_slos_ms={"ttft": 1000.0}))
    assert bench_keys <= set(result)
    assert result["request_goodput"] is not None
    assert set(result["mean_breakdown_ms"]) >= {"queue", "prefill", "transfer", "decode_wait"}
