"""Naming the OS thread a Python thread runs on, so per-thread CPU time (/proc, top -H, py-spy)
tells the engine loop from the event loop. Python names only its own `threading` record.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["name_native_thread"]

_PR_SET_NAME = 15  # prctl(2)


def name_native_thread(name: str) -> None:
    """Name the calling thread `name` (first 15 bytes) where the OS lets us; else nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        return
