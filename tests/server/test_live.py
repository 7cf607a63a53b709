"""The real thing: `disagg serve` on the default model in its own process, driven by the
unchanged `openai` client and raw HTTP. Bad input gets the OpenAI error shape and the server keeps
serving; a client that disconnects mid-stream gets its request aborted and its blocks freed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.engine.clear_answers import CLEAR_ANSWERS
from tests.helpers import free_port, wait_until


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _is_healthy(proc: subprocess.Popen, base: str) -> bool:
    assert proc.poll() is None, f"server exited with {proc.returncode}"
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(default_model_dir: Path) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "disagg.cli", "serve", "--model", str(default_model_dir)]
    cmd += ["--port", str(port), "--num-threads", "1", "--num-blocks", "256"]
    cmd += ["--served-model-name", "smollm2-135m", "--max-model-len", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _is_healthy(proc, base), "the server to answer /health", 120)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0, "serve did not exit cleanly on SIGTERM"
        finally:
            proc.kill()


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=60, max_retries=0)


def _idle_load(base: str) -> dict | None:
    """The server's /load once every block is free and nothing runs; None before."""
    load = _get(f"{base}/load")
    is_idle = load["num_free_blocks"] == load["num_total_blocks"] and not load["num_running"]
    return load if is_idle else None


def _wait_pool_full(base: str) -> dict:
    return wait_until(lambda: _idle_load(base), "the server frees every block", 15.0)


@pytest.mark.parametrize(("question", "answer"), CLEAR_ANSWERS)
def test_openai_chat_answers(
    client: openai.OpenAI, server: str, question: str, answer: str
) -> None:
    """At the default dtype (bf16 on a CPU with bf16 instructions), on questions whose answer
    is far from any tie in fp32 and bf16 alike (clear_answers); never one that sits on a tie."""
    reply = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
    )
    dtype = _get(f"{server}/v1/models")["data"][0]["dtype"]
    assert answer in reply.choices[0].message.content, (dtype, reply.choices[0].message.content)
    assert reply.usage.completion_tokens <= 16 and reply.usage.prompt_tokens > 5


def test_openai_completion_and_stream_agree(client: openai.OpenAI) -> None:
    prompt = "Once upon a time, there was a little girl named Lily. She"
    whole = client.completions.create(
        model="smollm2-135m",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    stream = client.completions.create(
        model="smollm2-135m",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == whole.choices[0].text


def test_openai_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


BAD_INPUTS = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (json.dumps({"model": "smollm2-135m"}).encode(), 400),  # no prompt
    (json.dumps({"model": "smollm2-135m", "prompt": 42}).encode(), 400),
    (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404),
    (json.dumps({"model": "smollm2-135m", "prompt": "hi " * 3000}).encode(), 400),
    (json.dumps({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 0}).encode(), 400),
    (json.dumps({"model": "smollm2-135m", "prompt": "hi", "temperature": -1}).encode(), 400),
    (json.dumps({"model": "smollm2-135m", "prompt": "hi", "top_p": 1.5}).encode(), 400),
    (json.dumps({"model": "smollm2-135m", "prompt": "hi", "top_p": 0}).encode(), 400),
    (json.dumps({"model": "smollm2-135m", "prompt": "hi", "n": 3}).encode(), 400),
]


@pytest.mark.parametrize(("body", "status"), BAD_INPUTS)
def test_bad_input_gets_openai_error_shape(server: str, body: bytes, status: int) -> None:
    req = urllib.request.Request(
        f"{server}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=30)
    assert caught.value.code == status
    error = json.loads(caught.value.read())["error"]
    assert error["message"] and error["type"] and "code" in error
    with urllib.request.urlopen(f"{server}/health", timeout=5) as resp:
        assert resp.status == 200  # still up
    _wait_pool_full(server)


def test_server_still_serves_after_bad_input(client: openai.OpenAI, server: str) -> None:
    reply = client.completions.create(
        model="smollm2-135m", prompt="Hello", max_tokens=3, temperature=0
    )
    assert reply.usage.completion_tokens >= 1
    _wait_pool_full(server)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: str) -> None:
    body = {"model": "smollm2-135m", "prompt": "Tell me a long story.", "max_tokens": 400}
    body |= {"stream": True, "temperature": 0, "ignore_eos": True}
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=30) as sock:
        payload = json.dumps(body).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(payload)}\r\n\r\n"
        sock.sendall(head.encode() + payload)
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(4096)
        assert _get(f"{server}/load")["num_running"] == 1
    load = _wait_pool_full(server)  # the server noticed, aborted, and freed the blocks
    assert load["num_waiting"] == 0
