"""`disagg route` as a process: ready line, serving, clean exit on SIGTERM/SIGINT; no torch."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from tests.helpers import free_port

READY_PREFIX = "disagg route ready on "


def start_router(*flags: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "route", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=20)
    except queue.Empty:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError("router never printed its ready line") from None
    assert line.startswith(READY_PREFIX), line
    return proc, line[len(READY_PREFIX) :].strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_route_serves_then_exits_cleanly_on_signal(sig: signal.Signals) -> None:
    dead_decode = f"http://127.0.0.1:{free_port()}"
    proc, url = start_router("--decode", dead_decode, "--host", "127.0.0.1")
    try:
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=5)
        assert info.value.code == 503
        info.value.close()
        with urllib.request.urlopen(url + "/instances", timeout=5) as resp:
            rows = json.loads(resp.read())
        assert [(r["url"], r["role"], r["healthy"]) for r in rows] == [(dead_decode, "both", False)]
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_route_rejects_pull_without_prefill() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "route", "--mode", "pull", "--decode", "h:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "prefill" in done.stderr


def test_router_modules_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import disagg.router.policy, disagg.router.instances, disagg.router.app\n"
        "import disagg.router.main\n"
        "assert 'torch' not in sys.modules, 'router imported torch'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
