"""`disagg status` never imports torch: it runs wherever an operator has a terminal."""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys
from disagg import cli
import disagg.status.main, disagg.status.probe, disagg.status.screen, disagg.status.snapshot
try:
    cli.main(["status", "--help"])
except SystemExit:
    pass
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""


def test_status_does_not_import_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")
