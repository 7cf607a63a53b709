"""benchmarks/late_binding_bench.py runs end to end (tiny checkpoint, tiny sizes) over every mode.

Mechanics only: with a tiny model the prefill is over before the burst starts, so where the new
requests land says nothing here. Each mode must produce its row, every new request must be
answered, and the D that served it must be identified; the entry point through
`stall_bench.py --experiment late-binding` must be the same benchmark.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import run_bench_script

MODES = ["push", "pull-background", "pull-inline"]


@pytest.mark.slow
def test_late_binding_bench_measures_every_mode(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "late_binding.json"
    args = [
        "--experiment", "late-binding", "--model", str(tiny_qwen3_dir), "--repeats", "1",
        "--prompt-len", "64", "--max-tokens", "4", "--num-new", "2", "--burst-size", "2",
        "--burst-max-tokens", "64", "--burst-delay-s", "0.01",
    ]  # fmt: skip
    result = run_bench_script("stall_bench.py", args, out, timeout_s=150)
    assert [row["mode"] for row in result["results"]] == MODES
    assert result["config"]["num_decode"] == 2 and result["config"]["policy"] == "least_loaded"
    for row in result["results"]:
        assert row["num_new"] == 2 and row["num_unknown_decode"] == 0
        assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] >= 0
        assert 0 <= row["on_busy_fraction"] <= 1
    for run in result["runs"]:
        assert sorted(r["burst_target"] for r in run["requests"]) == [0, 1]  # balanced draw
        for request in run["requests"]:
            assert request["served_by"] in (0, 1)
            assert request["on_busy"] == (request["served_by"] == request["burst_target"])
            assert request["num_chunks"] >= 1 and request["ttft_ms"] > 0
