"""The scripts of benchmarks/, run for their tests as a user runs them (a process of their own).

Holds the checks every such script owes: exit status 0, and the JSON document it writes is
also the last line of its stdout. What the document says is each test's business.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["BENCHMARKS_DIR", "run_bench_script"]

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
_TAIL_CHARS = 3000  # of stdout and stderr, to explain a failed run


def run_bench_script(name: str, args: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """Run benchmarks/`name` with `args` and `--out out`; the JSON document it wrote."""
    argv = [sys.executable, str(BENCHMARKS_DIR / name), *args, "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-_TAIL_CHARS:] + proc.stderr[-_TAIL_CHARS:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    return result
