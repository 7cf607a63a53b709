"""Errors a user causes at start-up end `disagg serve` with one line naming the thing and the
fix: no traceback (unless --debug), exit code 2 for bad input and 1 for the environment."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.cli import COMMANDS
from tests.no_nixl import write_no_nixl_dir

TOKEN = "t" * 32  # a cluster token long enough to pass validation
TIMEOUT_S = 120


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "disagg.cli", "serve", "--num-threads", "1", *args]
    full_env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN, **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=full_env)


def assert_one_line(proc: subprocess.CompletedProcess[str], code: int, *names: str) -> str:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disagg serve: error: "), proc.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def copy_without(model_dir: Path, tmp_path: Path, *dropped: str) -> Path:
    out = tmp_path / "model"
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns(*dropped))
    return out


def test_missing_tokenizer_names_the_file(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    model = copy_without(tiny_qwen3_dir, tmp_path, "tokenizer.json")
    proc = serve("--model", str(model), "--port", "0")
    assert_one_line(proc, 2, str(model / "tokenizer.json"), "no such file")


def test_missing_weights_name_the_directory(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    model = copy_without(tiny_qwen3_dir, tmp_path, "*.safetensors")
    assert_one_line(serve("--model", str(model), "--port", "0"), 2, "safetensors", str(model))


def test_unsupported_architecture_lists_the_supported(tiny_qwen3_dir: Path, tmp_path: Path):
    model = copy_without(tiny_qwen3_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config |= {"architectures": ["MambaForCausalLM"], "model_type": "mamba"}
    (model / "config.json").write_text(json.dumps(config))
    line = assert_one_line(serve("--model", str(model), "--port", "0"), 2, "MambaForCausalLM")
    assert "Qwen3ForCausalLM" in line


def test_unknown_model_name_lists_the_known(tmp_path: Path) -> None:
    proc = serve("--model", str(tmp_path / "nowhere"), "--port", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "nowhere" in proc.stderr and "smollm2-135m" in proc.stderr


def test_port_in_use_says_to_choose_another(tiny_qwen3_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = serve("--model", str(tiny_qwen3_dir), "--port", port, "--dtype", "float32")
    assert_one_line(proc, 1, port, "--port")


def test_nixl_asked_for_but_missing_names_the_extra(tiny_qwen3_dir: Path, tmp_path: Path):
    env = {"PYTHONPATH": f"{write_no_nixl_dir(tmp_path / 'no-nixl')}{os.pathsep}{os.getcwd()}"}
    args = ("--model", str(tiny_qwen3_dir), "--role", "prefill", "--kv-transport", "nixl")
    line = assert_one_line(serve(*args, env=env), 2, "disagg[nixl]", "--kv-transport tcp")
    assert "needs NIXL" in line


def test_debug_shows_the_traceback(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    model = copy_without(tiny_qwen3_dir, tmp_path, "tokenizer.json")
    proc = serve("--model", str(model), "--port", "0", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_every_command_has_help(command: str) -> None:
    parser = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    flags = [a for a in parser._actions if a.option_strings]  # argparse keeps them here
    undocumented = [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    assert not undocumented, f"flags of disagg {command} without help: {undocumented}"
    assert not [a.help for a in flags if "Config." in (a.help or "")], "internal field names"
