"""The engine's core (requests, blocks, scheduling) stays pure Python: no torch import."""

from __future__ import annotations

import subprocess
import sys

PURE = [
    "disagg.engine.request",
    "disagg.engine.block_pool",
    "disagg.engine.kv_cache_manager",
    "disagg.engine.scheduler",
    "disagg.engine.outputs",
]


def test_core_modules_do_not_import_torch() -> None:
    code = "\n".join(
        [*(f"import {name}" for name in PURE), "import sys", "print('torch' in sys.modules)"]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
