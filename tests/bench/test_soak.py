"""benchmarks/soak.py runs a short soak end to end on the tiny checkpoint and passes its checks.

Ten seconds of load over real push and pull clusters (the kill included): the script's own
exit status says nothing hung, no 200 had wrong text, every bad input got a proper 4xx and every
surviving pool is full again; the JSON it writes is the last stdout line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import run_bench_script


@pytest.mark.slow
def test_short_soak_passes_its_checks(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--duration-s", "10", "--concurrency", "2", "--client-timeout-s", "20"]
    args += ["--model", str(tiny_qwen3_dir)]
    doc = run_bench_script("soak.py", args, out, timeout_s=240)
    res = doc["results"]
    assert res["succeeded"] > 0 and res["rejected_ok"] > 0 and res["disconnects"] > 0
    assert res["killed"]["name"] == "push-decode-0"
    assert res["pools_full"] and "push-decode-0" not in res["children"]
