"""benchmarks/soak.py runs a short soak end to end on the tiny checkpoint and passes its checks.

Ten seconds of load over real push and pull clusters (the kill included): the script's own
exit status says nothing hung, no 200 had wrong text, every bad input got a proper 4xx and every
surviving pool is full again; the JSON it writes is the last stdout line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_short_soak_passes_its_checks(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--duration-s", "10", "--concurrency", "2", "--client-timeout-s", "20"]
    args += ["--model", str(tiny_qwen3_dir)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == doc
    res = doc["results"]
    assert res["succeeded"] > 0 and res["rejected_ok"] > 0 and res["disconnects"] > 0
    assert res["killed"]["name"] == "push-decode-0"
    assert res["pools_full"] and "push-decode-0" not in res["children"]
