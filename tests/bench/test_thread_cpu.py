"""thread_cpu_seconds: per-thread CPU time and OS thread names from /proc."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from disagg.bench.thread_cpu import thread_cpu_seconds
from disagg.engine.native_thread import name_native_thread


def _stat(name: str, utime: int, stime: int) -> str:
    # pid (comm) state ppid ... : utime and stime are fields 14 and 15 of the whole line.
    rest = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 5
    return f"7 ({name}) " + " ".join(rest) + "\n"


def test_reads_names_and_ticks_from_a_proc_tree(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    for tid, name, ut, st in ((7, "python", tick, 0), (8, "odd) name", 2 * tick, tick)):
        task = tmp_path / "7" / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "stat").write_text(_stat(name, ut, st))
    (tmp_path / "7" / "task" / "9").mkdir()  # exited while read: no stat file, left out
    assert thread_cpu_seconds(7, tmp_path) == {7: ("python", 1.0), 8: ("odd) name", 3.0)}


def test_a_gone_process_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        thread_cpu_seconds(12345, tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_named_busy_thread_is_told_apart() -> None:
    def spin() -> None:
        name_native_thread("engine-loop")
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        found.update(thread_cpu_seconds(os.getpid()))

    found: dict[int, tuple[str, float]] = {}
    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    named = [seconds for name, seconds in found.values() if name == "engine-loop"]
    assert len(named) == 1 and named[0] > 0
