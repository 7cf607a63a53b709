"""benchmarks/multiturn_bench.py runs end to end (tiny checkpoint, two short conversations)
over an aggregated and a disaggregated configuration, alternated.

The figures are not asserted (the machine is shared): every turn of every run must be
answered, each configuration must get its row and its ratio to the first, and the per-turn
TTFTs must cover every turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import run_bench_script


@pytest.mark.slow
def test_multiturn_bench_alternates_its_configurations(
    tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    args = [
        "--model", str(tiny_qwen3_dir), "--configs", "agg2-rr,pull-ll,pull-kv-local64",
        "--rounds", "1",
        "--conversations", "2", "--turns", "2", "--system-len", "40", "--user-len", "8",
        "--answer-len", "4",
    ]  # fmt: skip
    result = run_bench_script("multiturn_bench.py", args, tmp_path / "mt.json", timeout_s=300)
    names = ["agg2-rr", "pull-ll", "pull-kv-local64"]
    assert [row["config"] for row in result["results"]] == names
    assert [run["config"] for run in result["runs"]] == names
    for run in result["runs"]:
        assert (run["completed"], run["failed"]) == (4, 0)
        assert set(run["median_ttft_ms_by_turn"]) == {"1", "2"}
        assert run["prefill_tokens_per_request"] > 0
    runs = {run["config"]: run for run in result["runs"]}
    assert runs["agg2-rr"]["kv_bytes_per_request"] == 0  # nothing moves between instances
    assert runs["pull-ll"]["kv_bytes_per_request"] > 0
    assert result["results"][0]["median_ttft_ms_later_turns_vs_agg2-rr"] == 1.0
    assert result["config"]["host"]["model"]
