"""What `pip install .` gives a user: a wheel whose only optional part is NIXL, and, in a fresh
virtual environment without NIXL, a `disagg up --mode push` that serves over TCP; with the
`nixl` extra installed, the same `auto` transport resolves to NIXL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.engine import cpu_kernels
from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
PIP_TIMEOUT_S = 600
UP_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*argv, "-w", str(out), str(ROOT)], check=True, timeout=PIP_TIMEOUT_S)
    (built,) = out.glob("disagg-*.whl")
    return built


def metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return zf.read(name).decode()


def test_nixl_is_an_extra_not_a_requirement(wheel: Path) -> None:
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata(wheel), re.MULTILINE)
    nixl = [r for r in requires if r.lower().startswith("nixl")]
    assert nixl and all('extra == "nixl"' in r for r in nixl), nixl
    assert "Provides-Extra: nixl" in metadata(wheel)
    with zipfile.ZipFile(wheel) as zf:  # the simulator's profiles travel with the package
        assert "disagg/sim/hardware/h200-p5en.toml" in zf.namelist()
        for source in cpu_kernels.SOURCES:  # built at first use
            assert f"disagg/engine/csrc/{source.name}" in zf.namelist()


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    """A new virtual environment with only the wheel and its dependencies (no NIXL)."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # The torch already in use here: a bare resolve may pick a multi-GB CUDA build.
    import torch

    subprocess.run([*pip, f"torch=={torch.__version__}", str(wheel)], check=True,
                   timeout=PIP_TIMEOUT_S)  # fmt: skip
    yield venv


def venv_run(venv: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=venv)  # fmt: skip


def test_a_fresh_install_serves_push_over_tcp_then_nixl_with_the_extra(
    fresh_venv: Path, wheel: Path
) -> None:
    py = str(fresh_venv / "bin" / "python")
    probe = "from disagg.kv.transport import resolve_kind; print(resolve_kind('auto'))"
    assert venv_run(fresh_venv, py, "-c", probe).stdout.strip() == "tcp"

    model = fresh_venv / "tiny"
    made = venv_run(fresh_venv, "disagg", "make-model", "--out", str(model), "--layers", "1")
    assert made.returncode == 0, made.stderr
    port = free_port()
    argv = ["disagg", "up", "--mode", "push", "--model", str(model), "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{fresh_venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    log = fresh_venv / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([*argv, "--threads-per-instance", "1"], stdout=out,
                              stderr=subprocess.STDOUT, env=env, cwd=fresh_venv)  # fmt: skip
    try:
        wait_ready(up, log)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=60) as resp:
            model_id = json.loads(resp.read())["data"][0]["id"]
        body = {"model": model_id, "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True}
        answer = post(f"{base}/v1/completions", body)
        assert answer["usage"]["completion_tokens"] == 4, answer
    finally:
        up.terminate()
        up.wait(timeout=60)

    extra = venv_run(fresh_venv, py, "-m", "pip", "install", "-q", f"{wheel}[nixl]",
                     timeout=PIP_TIMEOUT_S)  # fmt: skip
    assert extra.returncode == 0, extra.stderr
    assert venv_run(fresh_venv, py, "-c", probe).stdout.strip() == "nixl"


def wait_ready(up: subprocess.Popen[bytes], log: Path) -> None:
    """Until `disagg up` prints that it is ready (it does once every instance answers)."""
    wait_until(lambda: _is_ready(up, log), f"disagg up is ready (log: {log.name})", UP_TIMEOUT_S)


def _is_ready(up: subprocess.Popen[bytes], log: Path) -> bool:
    text = log.read_text(errors="replace")
    assert up.poll() is None, "disagg up exited before it was ready:\n" + text
    return "disagg up ready on" in text


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())
