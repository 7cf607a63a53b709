"""The engine's core (requests, blocks, scheduling) stays pure Python: no torch import."""

from __future__ import annotations

import subprocess
import sys

from disagg.engine.fences import Fences

PURE = [
    "disagg.engine.request",
    "disagg.engine.block_pool",
    "disagg.engine.kv_cache_manager",
    "disagg.engine.scheduler",
    "disagg.engine.outputs",
    "disagg.engine.fences",
]


def test_core_modules_do_not_import_torch() -> None:
    code = "\n".join(
        [*(f"import {name}" for name in PURE), "import sys", "print('torch' in sys.modules)"]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_fences_expire_and_stay_bounded() -> None:
    """A fence holds for its ttl only, and a flood of fenced aborts keeps the newest ones."""

    fences = Fences(ttl_s=10.0, max_ids=3)
    fences.add("a", now=0.0)
    assert fences.holds("a", now=10.0) and not fences.holds("a", now=10.1)
    for i, rid in enumerate("bcde"):
        fences.add(rid, now=1.0 + i)
    assert len(fences) == 3 and not fences.holds("b", now=5.0) and fences.holds("e", now=5.0)
    fences.add("z", now=100.0)  # everything older has expired
    assert len(fences) == 1
