"""The benchmark's progress display: tqdm's bar on a terminal, a few whole lines anywhere else.

A bar redraws itself with carriage returns, which a log file or captured output keeps as
noise; off a terminal each tenth of the requests gets one plain line instead. Owns display
only (the client counts); never imports torch.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress"]

_NUM_STEPS = 10  # plain lines off a terminal: one per tenth of the requests


class Progress:
    """Finished requests out of `total`, shown on `stream` (default: stderr) when `is_shown`."""

    def __init__(self, total: int, *, is_shown: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.num_done = 0
        self._stream = stream or sys.stderr
        self._start_s = time.perf_counter()
        self._num_steps_printed = 0
        is_terminal = is_shown and self._stream.isatty()
        self._bar = tqdm(total=total, unit="req", file=self._stream) if is_terminal else None
        self._is_plain = is_shown and not is_terminal

    def update(self, num: int = 1) -> None:
        self.num_done += num
        if self._bar is not None:
            self._bar.update(num)
        elif self._is_plain:
            step = _step_of(self.num_done, self.total)
            if step > self._num_steps_printed:
                self._num_steps_printed = step
                elapsed_s = time.perf_counter() - self._start_s
                print(f"bench: {self.num_done}/{self.total} requests done, {elapsed_s:.1f} s",
                      file=self._stream, flush=True)  # fmt: skip

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _step_of(num_done: int, total: int) -> int:
    """Which tenth of `total` `num_done` has reached (the last one exactly at `total`)."""
    return _NUM_STEPS if num_done >= total else num_done * _NUM_STEPS // max(total, 1)
