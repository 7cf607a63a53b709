from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from disagg.cli import main

_NO_TORCH = """
import sys
from disagg.cli import main
main(["sim", "--mode", "push", "--num-prompts", "3", "--model", "SmolLM2-135M",
      "--num-blocks", "256", "--input-len", "64", "--output-len", "4"])
assert "torch" not in sys.modules, "torch was imported"
assert "aiohttp" not in sys.modules, "aiohttp was imported"
"""


def test_sim_command_writes_a_bench_result(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "sim.json"
    argv = ["sim", "--mode", "pull", "--num-prompts", "4", "--input-len", "256"]
    argv += ["--model", "Qwen3-8B", "--num-blocks", "512", "--request-rate", "2"]
    assert main([*argv, "--result-file", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["simulated"] is True and result["completed"] == 4
    assert result["sim"]["mode"] == "pull"
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line)["completed"] == 4


def test_bad_flags_exit_2(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["sim", "--model", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_sim_imports_neither_torch_nor_aiohttp() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_conversations_are_simulated_turn_by_turn(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["sim", "--dataset", "multiturn", "--num-turns", "3", "--num-prompts", "2",
            "--prefix-len", "64", "--input-len", "32", "--output-len", "8", "--model", "Qwen3-8B",
            "--policy", "kv_aware"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT by turn" in out and "simulated 6 requests" in out
