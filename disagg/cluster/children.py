"""The local launcher's child processes: one record per child across its port-clash retries,
its log file and the report of its exit, and ordered termination (SIGTERM, then SIGKILL).
No cluster logic (cluster/launcher.py has it), no port or health plumbing (processes.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from disagg.cluster.processes import connect_host, url_of

__all__ = ["Child", "terminate"]

KILL_WAIT_S = 5.0  # after SIGKILL; only a process stuck in the kernel takes longer
LOG_TAIL_LINES = 20


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
