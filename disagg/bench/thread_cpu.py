"""CPU time each thread of a process has spent, read from /proc (Linux), with the OS thread names
that tell an engine loop (`engine-loop`, named by the engine) from an event loop or a library's
own threads. Benchmarks and `disagg sim calibrate` take differences over a run.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["thread_cpu_seconds"]


def thread_cpu_seconds(pid: int, proc: Path = Path("/proc")) -> dict[int, tuple[str, float]]:
    """{thread id: (OS thread name, user + system CPU-seconds so far)} of process `pid`. A
    thread that exits while it is read is left out (its time no longer counts); a process that
    is gone raises OSError."""
    tick = os.sysconf("SC_CLK_TCK")
    threads: dict[int, tuple[str, float]] = {}
    for task in (proc / str(pid) / "task").iterdir():
        try:
            head, _, rest = (task / "stat").read_text().rpartition(")")
        except OSError:
            continue
        fields = rest.split()  # after the name: state is field 0, utime 11, stime 12
        seconds = (int(fields[11]) + int(fields[12])) / tick
        threads[int(task.name)] = (head.split("(", 1)[1], seconds)
    return threads
