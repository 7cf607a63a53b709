"""The event loop: a virtual clock and a heap of timed actions. Nothing here reads a real clock.

Events at the same time run in the order they were scheduled, so a seeded run is reproducible.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Event", "EventLoop"]


@dataclass(frozen=True, slots=True, order=True)
class Event:
    time_s: float  # virtual time it fires at
    seq: int  # tie-break: scheduling order
    action: Callable[[], None] = field(compare=False)


class EventLoop:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.num_events = 0
        self._heap: list[Event] = []
        self._seq = itertools.count()

    def at(self, time_s: float, action: Callable[[], None]) -> None:
        """Run `action` at virtual time `time_s` (never before now)."""
        assert time_s >= self.now_s - 1e-12, f"event in the past: {time_s} < {self.now_s}"
        heapq.heappush(self._heap, Event(max(time_s, self.now_s), next(self._seq), action))

    def after(self, delay_s: float, action: Callable[[], None]) -> None:
        self.at(self.now_s + delay_s, action)

    def run(self, until_s: float = float("inf")) -> None:
        """Fire events in time order until none is left (or the clock passes `until_s`)."""
        while self._heap and self._heap[0].time_s <= until_s:
            event = heapq.heappop(self._heap)
            self.now_s = event.time_s
            self.num_events += 1
            event.action()
