"""The `disagg` entry point itself: version and help for a user, not for a reader of the code."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from disagg.cli import COMMANDS, main

_NO_ROUTER = "http://127.0.0.1:1"  # port 1: refused at once


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"disagg {version('disagg')}"


def test_help_lists_every_command_for_a_user(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in COMMANDS)
    assert "module" not in text  # says what the tool does, not where its code lives


def _status(*args: str) -> subprocess.Popen[bytes]:
    """`disagg status --json` against a port nothing listens on: each snapshot is one line."""
    argv = [sys.executable, "-m", "disagg.cli", "status", "--json", "--router", _NO_ROUTER, *args]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip


def test_a_reader_that_stops_early_ends_the_command_quietly() -> None:
    """Regression: `disagg status --once --json | head` printed `[Errno 32] Broken pipe`."""
    streaming = _status("--interval", "0.05")
    assert streaming.stdout is not None and streaming.stdout.readline().startswith(b"{")
    streaming.stdout.close()  # `head -1`: one line read, then gone
    once = _status("--once")
    assert once.stdout is not None
    once.stdout.close()  # gone before the command wrote anything
    for proc in (streaming, once):
        _, err = proc.communicate(timeout=60)
        assert err == b"", err.decode()  # neither the error line nor "Exception ignored"
        assert proc.returncode == 128 + signal.SIGPIPE  # as a shell reports `yes | head`
