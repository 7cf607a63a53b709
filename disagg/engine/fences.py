"""Request ids that must not be submitted any more: the router's fenced aborts.

A pull handoff ends with the client gone after the router sent the decode leg. The router
cannot tell whether the decode instance took it (its handler may still be reading or
tokenizing the body, or the leg may never have fully arrived), and until it knows, P's lease
cannot be released: a decode instance may still read those blocks. So it asks: "abort this id
and, if you do not hold it, never take it". A fence answers that question atomically on the
event loop that also submits, and holds long enough that a late handler meets it. Pure.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Fences"]


class Fences:
    """Ids refused until their fence expires (monotonic seconds); the oldest go first past
    `max_ids`, so a flood of aborts cannot grow memory."""

    def __init__(self, ttl_s: float, max_ids: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._until: OrderedDict[str, float] = OrderedDict()  # id -> expiry, oldest first

    def add(self, request_id: str, now: float) -> None:
        self._expire(now)
        self._until.pop(request_id, None)
        self._until[request_id] = now + self.ttl_s
        while len(self._until) > self.max_ids:
            self._until.popitem(last=False)

    def holds(self, request_id: str, now: float) -> bool:
        until = self._until.get(request_id)
        return until is not None and until >= now

    def _expire(self, now: float) -> None:
        while self._until:
            request_id, until = next(iter(self._until.items()))
            if until >= now:
                return
            del self._until[request_id]

    def __len__(self) -> int:
        return len(self._until)
