"""The benchmark never imports torch (it must run wherever a client can)."""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys
import disagg.bench.arrivals, disagg.bench.client, disagg.bench.metrics
import disagg.bench.main, disagg.bench.report, disagg.bench.sweep, disagg.bench.workload
from disagg.bench.report import _pyplot
_pyplot()
from disagg.bench.workload import WorkloadConfig, make_workload
make_workload(WorkloadConfig(dataset="text", num_prompts=2))
assert "disagg.bench.main" in sys.modules
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""


def test_bench_does_not_import_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
