"""`disagg status` over real HTTP against canned endpoints (stdlib servers in threads): the
snapshot, `--once --json`, a down router, a slow instance, and the live view in a terminal.

The canned answers are the fakes' (real metric registries); no engine or router runs here.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg import cli
from disagg.protocol import TTFTBreakdown
from disagg.status.answer import Answer
from disagg.status.probe import fetch, take_snapshot
from tests.helpers import free_port
from tests.status.fakes import FixedLoadEngine, instance_answers, make_load, router_answers

DELAY_PATH = "/slow"


@contextlib.contextmanager
def canned_server(answers: Mapping[str, Answer]) -> Iterator[str]:
    """Serve path -> Answer on 127.0.0.1; `DELAY_PATH` answers after a second. Yields the URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path == DELAY_PATH:
                time.sleep(1.0)
            answer = answers.get(self.path, Answer(404, b"not found"))
            self.send_response(answer.status or 500)
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)

        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    """A URL nothing listens on (the port was free a moment ago)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def router_url() -> Iterator[str]:
    """A router listing one answering decode instance and one that is down."""
    kv_info = {"role": "decode", "connector": "push", "transport": "tcp",
               "stats": {"transfers": 4, "transfers_failed": 0}}  # fmt: skip
    engine = FixedLoadEngine(make_load(running=1, free=10, total=16), kv_info)
    breakdown = TTFTBreakdown(transfer_s=0.05, first_step_s=0.01)
    dead = closed_port_url()
    with canned_server(instance_answers(engine, [breakdown], ["length"])) as decode:
        rows = [{"url": decode, "role": "decode", "healthy": True},
                {"url": dead, "role": "prefill", "healthy": False}]  # fmt: skip
        with canned_server(router_answers(rows, ["200", "200"])) as router:
            yield router


def test_snapshot_over_http_shows_the_live_instance_and_the_dead_one(router_url: str):
    status = take_snapshot(router_url, timeout_s=2.0)
    assert status.router.health == "ok" and status.router.num_requests == 2
    live, dead = status.instances
    assert (live.role, live.health, live.connector, live.num_handoffs) == (
        "decode",
        "ok",
        "push",
        4,
    )
    assert (live.num_blocks_used, live.num_blocks_total) == (6, 16)
    assert live.stage_means_s == pytest.approx({"transfer": 0.05, "first_step": 0.01})
    assert (dead.role, dead.health, dead.num_blocks_total) == ("prefill", "down", None)
    assert "refused" in dead.problems[0].lower()


def test_once_json_prints_one_document(router_url: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["status", "--router", router_url, "--once", "--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert out.count("\n") == 1
    assert [(i["role"], i["health"]) for i in doc["instances"]] == [
        ("decode", "ok"),
        ("prefill", "down"),
    ]
    assert doc["instances"][0]["num_blocks_total"] == 16


def test_router_that_does_not_answer_exits_1_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
):
    assert cli.main(["status", "--router", closed_port_url(), "--once"]) == 1
    captured = capsys.readouterr()
    assert "DOWN" in captured.out and "Traceback" not in captured.out + captured.err


def test_bad_router_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["status", "--router", "ftp://somewhere", "--once"]) == 2
    assert "--router must look like http://host:port" in capsys.readouterr().err


def test_slow_endpoint_times_out_as_no_answer():
    with canned_server({}) as url:
        started = time.monotonic()
        answer = fetch(f"{url}{DELAY_PATH}", timeout_s=0.2)
    assert answer.status is None and answer.error, answer
    assert time.monotonic() - started < 0.9


def test_http_error_keeps_its_status():
    with canned_server({"/health": Answer(503, b'{"status": "engine dead"}')}) as url:
        answer = fetch(f"{url}/health", timeout_s=2.0)
    assert (answer.status, answer.error, answer.is_ok) == (503, "HTTP 503", False)


def _read_until(fd: int, needle: bytes, timeout_s: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout_s
    while needle not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    return seen


def test_live_view_in_a_terminal_refreshes_and_quits_on_q(router_url: str):
    """The interactive path: a pseudo-terminal, the alternate screen, two frames, `q` to quit,
    and the terminal restored (cursor shown, main screen back)."""
    primary, secondary = pty.openpty()
    argv = [
        sys.executable,
        "-m",
        "disagg.cli",
        "status",
        "--router",
        router_url,
        "--interval",
        "0.3",
    ]
    env = {**os.environ, "COLUMNS": "160", "LINES": "40"}
    proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary, env=env)
    os.close(secondary)
    try:
        screen = _read_until(primary, b"\x1b[?1049h", timeout_s=30)
        screen += _read_until(primary, b"first_step", timeout_s=30)
        screen += _read_until(primary, b"\x1b[H", timeout_s=10)  # the second frame starts
        os.write(primary, b"q")
        assert proc.wait(timeout=10) == 0
        screen += _read_until(primary, b"\x1b[?1049l", timeout_s=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(primary)
    text = screen.decode(errors="replace")
    assert "disagg status" in text and "decode" in text and "down" in text
    assert text.count("\x1b[H\x1b[2J") >= 2, "expected at least two frames"
    assert text.rstrip().endswith("\x1b[?1049l"), "the main screen was not restored"
    assert "Traceback" not in text
