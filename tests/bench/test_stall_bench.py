"""benchmarks/stall_bench.py runs end to end (tiny checkpoint, tiny sizes) over every mode.

The figures themselves are not asserted (the machine is shared): each mode must produce its
row, the new requests must all be answered, and the disaggregated modes must report one
loop-blocked observation per new request on the decode instance.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import run_bench_script

MODES = ["pull-inline", "pull-background", "push", "aggregated"]


@pytest.mark.slow
def test_stall_bench_measures_every_mode(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "stall_bench.json"
    args = [
        "--model", str(tiny_qwen3_dir), "--repeats", "1", "--prompt-len", "64", "--num-new", "2",
        "--num-running", "2", "--gap-s", "0.2", "--baseline-s", "0.3",
        "--steady-max-tokens", "3000",
    ]  # fmt: skip
    result = run_bench_script("stall_bench.py", args, out, timeout_s=240)
    assert [row["mode"] for row in result["results"]] == MODES
    for run in result["runs"]:
        assert len(run["new_ttft_ms_each"]) == 2 and all(t > 0 for t in run["new_ttft_ms_each"])
        assert run["num_itl_window"] > 0 and run["num_itl_baseline"] > 0
        # >= 0: a tiny model's tokens can share one socket read, so one client timestamp
        assert run["itl_max_ms"] >= run["itl_p99_ms"] >= run["itl_p50_ms"] >= 0
        if run["mode"] == "aggregated":
            assert run["num_handoffs"] == 0 and run["loop_blocked_ms_per_handoff"] is None
        else:
            assert run["num_handoffs"] == 2 and len(run["loop_blocked_ms_each"]) == 2
            assert run["loop_blocked_ms_per_handoff"] >= 0
    assert result["background_vs_inline"] is not None
