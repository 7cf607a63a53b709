"""`disagg serve`: flags build the configs; the process serves, then shuts down on SIGTERM."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import requests

from disagg.config import EngineConfig
from disagg.security import auth
from disagg.server import main
from tests.helpers import free_port, wait_until
from tests.server.fakes import ScriptedEngine

_TOKEN = "serve-tests-cluster-token"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_build_configs() -> None:
    args = _parse(
        "--model", "m", "--port", "0", "--kv-host", "10.0.0.1",
        "--role", "decode", "--kv-connector", "push", "--no-prefix-caching",
        "--block-size", "32", "--max-model-len", "512", "--lease-s", "2.5",
        "--cluster-token", _TOKEN,
    )  # fmt: skip
    engine, server = main.build_configs(args)
    assert (engine.model, server.port, server.host) == ("m", 0, "127.0.0.1")
    kv = engine.kv_transfer
    assert (kv.host, kv.role, kv.connector, kv.lease_s) == ("10.0.0.1", "decode", "push", 2.5)
    assert kv.cluster_token == _TOKEN and _TOKEN not in repr(engine)  # never logged
    assert engine.scheduler.enable_prefix_caching is False
    assert (engine.cache.block_size, engine.scheduler.max_model_len) == (32, 512)
    defaults, _ = main.build_configs(_parse())
    assert defaults == EngineConfig()


def test_bad_flags() -> None:
    with pytest.raises(SystemExit):
        _parse("--role", "sideways")  # choices come from the config's Literal
    assert main.run(_parse("--block-size", "3")) == 2  # config validation -> exit 2


class _FakeAsyncEngine(ScriptedEngine):
    """AsyncEngine's lifecycle over ScriptedEngine."""

    instances: list[_FakeAsyncEngine] = []

    def __init__(
        self, config: EngineConfig, model_dir: Any, *, exit_on_death: bool, make_connector: Any
    ) -> None:
        super().__init__(output_ids=[40, 41, 42], model_name=config.model_name)
        assert exit_on_death, "a served engine must exit when its loop dies"
        self.model_dir = Path(model_dir)
        self.events: list[str] = []
        _FakeAsyncEngine.instances.append(self)

    async def start(self) -> None:
        self.events.append("start")

    async def shutdown(self) -> None:
        self.events.append("shutdown")

    def set_address(self, host: str, port: int) -> None:
        self.events.append("address")

    def side_channel(self) -> dict[str, Any]:
        async def ping(body: dict[str, Any]) -> dict[str, Any]:
            return {"pong": body.get("n")}

        return {"/kv/ping": ping}


def test_serve_until_sigterm(
    monkeypatch: pytest.MonkeyPatch, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = types.ModuleType("disagg.engine.checkpoint")
    checkpoint.resolve_model = lambda name: tokenizer_dir  # type: ignore[attr-defined]
    async_engine = types.ModuleType("disagg.engine.async_engine")
    async_engine.AsyncEngine = _FakeAsyncEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "disagg.engine.checkpoint", checkpoint)
    monkeypatch.setitem(sys.modules, "disagg.engine.async_engine", async_engine)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict[str, Any] = {}

    def client() -> None:
        try:
            wait_until(lambda: _is_up(url), "the server to answer /health")
            body = {"prompt": "Paris", "max_tokens": 2}
            seen["completion"] = requests.post(f"{url}/v1/completions", json=body, timeout=5)
            data = b'{"n": 1}'
            seen["unsigned"] = requests.post(f"{url}/kv/ping", data=data, timeout=5).status_code
            signature = auth.sign(_TOKEN, "POST", f"{url}/kv/ping", data)
            headers = {auth.SIGNATURE_HEADER: signature.header}
            answer = requests.post(f"{url}/kv/ping", data=data, headers=headers, timeout=5)
            seen["extra"] = answer.json()
            auth.check_answer(_TOKEN, answer.headers.get(auth.SIGNATURE_HEADER), signature.nonce,
                              answer.status_code, answer.content)  # fmt: skip
            seen["answer_signed"] = True
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # always, so run() cannot hang

    thread = threading.Thread(target=client)
    thread.start()
    argv = ("--model", "tiny", "--port", str(port), "--served-model-name", "t")
    assert main.run(_parse(*argv, "--cluster-token", _TOKEN)) == 0
    thread.join(timeout=10)
    engine = _FakeAsyncEngine.instances[-1]
    assert engine.events == ["start", "address", "shutdown"]
    assert engine.model_dir == tokenizer_dir
    assert seen["completion"].status_code == 200 and seen["completion"].json()["model"] == "t"
    assert seen["extra"] == {"pong": 1} and seen["answer_signed"]
    assert seen["unsigned"] == 401  # internal routes: cluster-signed calls only
    assert f"disagg serve ready on http://127.0.0.1:{port}\n" in capsys.readouterr().out


def _is_up(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=1).status_code == 200
    except requests.ConnectionError:
        return False


def test_serve_logs_the_dtype_it_computes_in(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """Regression: the README says the resolved dtype is logged, but `disagg serve` (and so each
    instance `disagg up` starts) never configured logging, and the engine's INFO line was lost."""
    log_path = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "disagg.cli", "serve", "--model", str(tiny_qwen3_dir),
            "--port", "0", "--num-threads", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        wait_until(lambda: b"ready on" in log_path.read_bytes() or proc.poll() is not None,
                   "serve to print its ready line or exit", 180)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert re.search(r"INFO disagg\.engine\.async_engine: engine computes in "
                     r"(float32|bfloat16) \(asked: auto\)\n", text), text  # fmt: skip
    assert "ready on" in text and len(text.splitlines()) <= 5, text  # startup says little else
