"""Process plumbing shared by everything that starts servers: free ports, health probes and
waits, children that die with their parent (PR_SET_PDEATHSIG), start/stop as a `with` block.

Used by the local launcher, the Ray backend and `disagg bench sweep`. Knows nothing of a
cluster's plan (cluster/launcher.py has it) and never imports torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Self

__all__ = [
    "HEALTH_POLL_S", "StartStop", "check_port_free", "connect_host", "die_with_parent_fn",
    "free_port", "free_ports", "is_healthy", "url_of", "wait_healthy",
]  # fmt: skip

HEALTH_POLL_S = 0.2  # between /health probes (and the liveness checks beside them)
HEALTH_TIMEOUT_S = 1.0  # one probe; a loaded instance still answers /health fast
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


def free_port() -> int:
    """A loopback TCP port free right now (the server binds it a moment later)."""
    return free_ports(1)[0]


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


def is_healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: no proxy
    try:
        with opener.open(url, timeout=HEALTH_TIMEOUT_S) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(url: str, deadline: float, check_alive: Callable[[], None] = lambda: None) -> bool:
    """Probe `url` until it answers 200 (True) or time.monotonic() passes `deadline` (False).

    At least one probe, however late; `check_alive()` runs before each and raises to give up
    (the server exited)."""
    while True:
        check_alive()
        if is_healthy(url):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(HEALTH_POLL_S)


def die_with_parent_fn() -> Callable[[], None] | None:
    """A preexec_fn that makes the kernel SIGKILL the child when its parent dies (Linux only).

    The kernel means the spawning *thread*: spawn from a thread that outlives the child."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork; the child only calls
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class StartStop(ABC):
    """A `with` block over start() and stop(): stop() runs however the block ends."""

    @abstractmethod
    def start(self) -> object:
        """Start everything; stop() must be safe to call after a start that raised."""

    @abstractmethod
    def stop(self) -> object:
        """Stop whatever was started; idempotent."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
