"""Local `disagg` child processes as soak.py and abuse_bench.py start them by hand: the tiny
checkpoint they serve, dying with the parent, the ready line, /proc status and stopping.

Pure process plumbing: no HTTP and no benchmark logic (each script keeps its own checks).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HOST = "127.0.0.1"  # every child listens on loopback only
START_TIMEOUT_S = 300.0  # up to eight cold starts (soak.py) import torch at once on two cores
# A tiny random-weight Qwen3: a decode step is ~1 ms, so a stall of a few ms shows.
TINY_MODEL_ARGS = ["--arch", "qwen3", "--layers", "2", "--hidden", "64", "--heads", "4",
                   "--kv-heads", "2", "--intermediate", "128", "--vocab", "2048",
                   "--seed", "1"]  # fmt: skip
_READY = re.compile(rb"ready on (http://[\w.\-]+:\d+)")


def make_tiny_model(model_dir: Path) -> None:
    """Write the TINY_MODEL_ARGS checkpoint to `model_dir` (torch only in the child)."""
    cmd = [sys.executable, "-m", "disagg.cli", "make-model", *TINY_MODEL_ARGS, "--out"]
    subprocess.run([*cmd, str(model_dir)], check=True, stdout=subprocess.DEVNULL)


def die_with_parent() -> None:
    """A child's preexec_fn: SIGKILL when this process dies, however it dies."""
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def ready_url(log_path: Path) -> str | None:
    """The URL a `disagg serve` / `disagg route` child logged as ready on, if it did yet."""
    found = _READY.search(log_path.read_bytes())
    return found.group(1).decode() if found else None


def proc_status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as {field: raw value} ("VmRSS": "  1234 kB")."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines)


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU time of `root` and every process below it, in seconds (a process
    that already exited counts no more: take the difference over a run of live servers)."""
    return sum(_cpu_seconds(pid) for pid in tree_pids(root))


def tree_pids(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(parents.get(pid, []))
    return pids


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM (peak RSS) and VmPeak (peak address space) of a process, in MiB."""
    fields = proc_status(pid)
    return {
        key: round(int(fields[key].split()[0]) / 1024, 1) for key in ("VmRSS", "VmHWM", "VmPeak")
    }


def reap(popen: subprocess.Popen[bytes]) -> None:
    """Wait for a child already sent SIGTERM; SIGKILL it if it takes more than 10 s."""
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(5)
