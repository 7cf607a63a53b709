"""The scheduler's waiting queue: a deque that also keeps the sum of its requests' tokens.

`Scheduler.load()` reports the prefill tokens queued on an instance; the router reads it for
every routing decision. Summing the queue each time made routing O(queue): under overload
(thousands waiting, as in a saturated 16k-token run) that sum dominated. Requests do not change
length while they wait (tokens are appended only by a step), so the sum is kept as requests
enter and leave.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from disagg.engine.request import Request

__all__ = ["WaitingQueue"]


class WaitingQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self.num_tokens = 0  # sum of num_tokens over the queue

    def append(self, request: Request) -> None:
        self._queue.append(request)
        self.num_tokens += request.num_tokens

    def appendleft(self, request: Request) -> None:
        self._queue.appendleft(request)
        self.num_tokens += request.num_tokens

    def popleft(self) -> Request:
        request = self._queue.popleft()
        self.num_tokens -= request.num_tokens
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self.num_tokens -= request.num_tokens

    def check_integrity(self) -> None:
        """Raise if the kept token sum is stale, or a waiting request holds computed tokens
        (a head that could not start is reset, so the sum is what is left to prefill)."""
        queued = [(r.request_id, r.num_computed_tokens) for r in self._queue]
        if self.num_tokens != sum(r.num_tokens for r in self._queue) or any(
            computed for _, computed in queued
        ):
            raise AssertionError(
                f"waiting queue's token sum {self.num_tokens} is stale, or a waiting "
                f"request holds computed tokens: {queued[:8]}"
            )

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
