"""Small helpers every test package shares: a free loopback port and a polling wait.

Never imports torch (tests that check `"torch" not in sys.modules` use these too).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "wait_until"]

HOST = "127.0.0.1"
WAIT_TIMEOUT_S = 10.0  # threads and children answer in well under this on a loaded machine
_POLL_S = 0.02


def free_port() -> int:
    """A TCP port on 127.0.0.1 free a moment ago (the caller binds it next)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> Any:
    """Poll `condition` until it returns something true (returned); AssertionError naming
    `what` at timeout, so a wait that never ends fails the test that waited."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting until {what}"
        time.sleep(_POLL_S)
    return value
