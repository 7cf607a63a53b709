"""The launcher's child processes: free ports, one log file each, health probes, dying with the
launcher (PR_SET_PDEATHSIG) and ordered termination. No cluster logic (launcher.py has it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Child", "check_port_free", "connect_host", "die_with_parent_fn", "free_ports", "is_healthy",
    "make_log_dir", "terminate", "url_of",
]  # fmt: skip

HEALTH_TIMEOUT_S = 1.0  # one probe; a loaded instance still answers /health fast
KILL_WAIT_S = 5.0  # after SIGKILL; only a process stuck in the kernel takes longer
LOG_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def free_ports(num_ports: int) -> list[int]:
    """Distinct loopback TCP ports free right now (all held open together, so never repeated)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(num_ports)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's server does
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot use port {port} on {host} for the router: {exc}") from exc


def connect_host(host: str) -> str:
    # A wildcard bind address is not something to connect to.
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(slots=True)
class Child:
    """One child process (an instance or the router) across its port-clash retries."""

    name: str  # "prefill-0", "decode-1", "both-0", "router"
    role: str  # the serve role, or "router"
    make_command: Callable[[int], list[str]]  # port -> argv
    host: str  # where it binds
    port: int
    log_path: Path
    is_port_ours: bool = True  # picked by us, so a clash may be retried on another
    proc: subprocess.Popen[bytes] | None = None
    log_offset: int = 0  # where this attempt's output starts in log_path
    num_attempts: int = 0

    @property
    def url(self) -> str:
        return url_of(connect_host(self.host), self.port)

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-num_lines:])

    def exit_report(self, when: str = "") -> str:
        assert self.proc is not None, f"{self.name} was never started"
        return (
            f"{self.name} (pid {self.proc.pid}) exited with code {self.proc.returncode}{when}; "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )


def make_log_dir(log_dir: Path | None) -> Path:
    if log_dir is None:
        return Path(tempfile.mkdtemp(prefix="disagg-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


def die_with_parent_fn() -> Callable[[], None] | None:
    """A preexec_fn that makes the kernel SIGKILL the child when the launcher dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork; the child only calls
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def is_healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: no proxy
    try:
        with opener.open(url, timeout=HEALTH_TIMEOUT_S) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def terminate(children: list[Child], timeout_s: float) -> None:
    procs = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                print(f"disagg up: pid {proc.pid} survived SIGKILL", file=sys.stderr)
