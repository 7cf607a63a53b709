"""Metrics against hand-computed values (percentiles, TPOT, ITL, goodput, breakdown means)."""

from __future__ import annotations

import pytest

from disagg.bench.metrics import (
    RequestResult,
    compute_metrics,
    itls_s,
    max_concurrency,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    percentile_key,
    summarize_ms,
    tpot_s,
    ttft_s,
)


def _results() -> list[RequestResult]:
    r1 = RequestResult(10, 0.0, [0.1, 0.3, 0.6], 0.6, 3)  # ttft .1, itl .2 .3, tpot .25
    r1.breakdown = {"queue_s": 0.01, "prefill_s": 0.05, "num_bytes": 100}
    r2 = RequestResult(20, 1.0, [1.5], 1.5, 1)  # ttft .5, no itl, no tpot
    r3 = RequestResult(30, 0.5, [0.7, 0.8, 0.9, 1.0, 1.5], 1.6, 5)  # ttft .2, tpot .225
    r3.breakdown = {"queue_s": 0.03, "num_bytes": 300}
    r4 = RequestResult(40, 0.2, [], 0.4, 0, error="HTTP 500", breakdown={"queue_s": 9.0})
    return [r1, r2, r3, r4]


def test_per_request_derivations() -> None:
    r1, r2, r3, _ = _results()
    assert ttft_s(r1) == pytest.approx(0.1)
    assert itls_s(r1) == pytest.approx([0.2, 0.3])
    assert tpot_s(r1) == pytest.approx(0.25)  # (0.6 - 0.1) / (3 - 1)
    assert tpot_s(r2) is None and itls_s(r2) == []
    assert tpot_s(r3) == pytest.approx(0.225)  # (1.1 - 0.2) / (5 - 1)


def test_summary_percentiles_linear_interpolation() -> None:
    out = summarize_ms("ttft", [0.1, 0.5, 0.2], (90.0, 99.0, 99.9))
    assert out["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert out["median_ttft_ms"] == pytest.approx(200.0)
    assert out["std_ttft_ms"] == pytest.approx((86666.666 / 3) ** 0.5, rel=1e-6)
    assert out["p90_ttft_ms"] == pytest.approx(440.0)  # rank 1.8 between 200 and 500
    assert out["p99_ttft_ms"] == pytest.approx(494.0)
    assert out["p99.9_ttft_ms"] == pytest.approx(499.4)
    assert summarize_ms("itl", [], (99.0,)) == {
        "mean_itl_ms": 0.0,
        "median_itl_ms": 0.0,
        "std_itl_ms": 0.0,
        "p99_itl_ms": 0.0,
    }
    assert percentile_key("tpot", 50) == "p50_tpot_ms"


def test_compute_metrics_hand_values() -> None:
    m = compute_metrics(_results(), duration_s=2.0, percentiles=(90.0,))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["request_goodput"] is None  # no SLO given
    assert m["mean_tpot_ms"] == pytest.approx(237.5)
    assert m["std_tpot_ms"] == pytest.approx(12.5)
    assert m["p90_tpot_ms"] == pytest.approx(247.5)
    # ITLs pooled over requests: [200, 300, 100, 100, 100, 500] ms
    assert m["mean_itl_ms"] == pytest.approx(1300 / 6)
    assert m["median_itl_ms"] == pytest.approx(150.0)
    assert m["p90_itl_ms"] == pytest.approx(400.0)
    assert m["median_e2el_ms"] == pytest.approx(600.0)
    assert m["mean_e2el_ms"] == pytest.approx(2200 / 3)
    assert m["max_concurrent_requests"] == 2


def test_per_request_lists_include_failures() -> None:
    m = compute_metrics(_results(), duration_s=2.0)
    assert m["input_lens"] == [10, 20, 30, 40]
    assert m["output_lens"] == [3, 1, 5, 0]
    assert m["ttfts"] == pytest.approx([0.1, 0.5, 0.2, 0.0])
    assert m["itls"][2] == pytest.approx([0.1, 0.1, 0.1, 0.5]) and m["itls"][3] == []
    assert m["errors"] == ["", "", "", "HTTP 500"]


def test_breakdown_means_skip_failed_requests() -> None:
    m = compute_metrics(_results(), duration_s=2.0)
    assert m["mean_breakdown_ms"] == pytest.approx({"queue": 20.0, "prefill": 50.0})
    assert m["mean_breakdown_counts"] == pytest.approx({"num_bytes": 200.0})


@pytest.mark.parametrize(
    ("slos", "goodput"),
    [
        ({"ttft": 250.0}, 1.0),  # r1 (100 ms) and r3 (200 ms)
        ({"ttft": 250.0, "tpot": 240.0}, 0.5),  # r1's TPOT is 250 ms
        ({"e2el": 550.0}, 0.5),  # only r2 (500 ms)
        ({"e2el": 550.0, "tpot": 1.0}, 0.5),  # r2 has no TPOT: meets it
        ({"ttft": 1000.0, "tpot": 1000.0, "e2el": 2000.0}, 1.5),  # all but the failed one
    ],
)
def test_goodput(slos: dict[str, float], goodput: float) -> None:
    assert compute_metrics(_results(), 2.0, (99.0,), slos)["request_goodput"] == pytest.approx(
        goodput
    )


def test_failed_request_never_meets_slos() -> None:
    assert not meets_slos(_results()[3], {"e2el": 1e9})


def test_max_concurrency_touching_intervals_do_not_overlap() -> None:
    a = RequestResult(1, 0.0, [0.5], 1.0, 1)
    b = RequestResult(1, 1.0, [1.5], 2.0, 1)
    c = RequestResult(1, 0.5, [0.6], 1.5, 1)
    assert max_concurrency([a, b]) == 1
    assert max_concurrency([a, b, c]) == 2


def test_parsers() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_percentiles("90, 99,99.9") == (90.0, 99.0, 99.9)
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    with pytest.raises(ValueError):
        parse_percentiles("0,50")
    with pytest.raises(ValueError):
        compute_metrics([], duration_s=0.0)
