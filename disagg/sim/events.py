"""The event loop: a virtual clock and a heap of timed actions. Nothing here reads a real clock.

Events at the same time run in the order they were scheduled, so a seeded run is reproducible.
The heap holds plain `(time_s, seq, action)` tuples: tuples compare in C, and a large run pushes
and pops hundreds of thousands of them (a dataclass's generated `__lt__` was ~5% of its time).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

__all__ = ["EventLoop"]

# (virtual time it fires at, scheduling order as the tie-break, what to run)
_Event = tuple[float, int, Callable[[], None]]


class EventLoop:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.num_events = 0
        self._heap: list[_Event] = []
        self._seq = itertools.count()

    def at(self, time_s: float, action: Callable[[], None]) -> None:
        """Run `action` at virtual time `time_s` (never before now)."""
        assert time_s >= self.now_s - 1e-12, f"event in the past: {time_s} < {self.now_s}"
        heapq.heappush(self._heap, (max(time_s, self.now_s), next(self._seq), action))

    def after(self, delay_s: float, action: Callable[[], None]) -> None:
        assert delay_s >= 0.0, f"negative delay {delay_s}"
        heapq.heappush(self._heap, (self.now_s + delay_s, next(self._seq), action))

    def run(self, until_s: float = float("inf")) -> None:
        """Fire events in time order until none is left (or the clock passes `until_s`)."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until_s:
            self.now_s, _, action = pop(heap)
            self.num_events += 1
            action()
