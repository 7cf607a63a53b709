"""The scheduler's waiting queue: a deque that also keeps the sum of its requests' tokens.

`Scheduler.load()` reports the prefill tokens queued on an instance; the router reads it for
every routing decision. Summing the queue each time made routing O(queue): under overload
(thousands waiting, as in a saturated 16k-token run) that sum dominated. Requests do not change
length while they wait (tokens are appended only by a step), so the sum is kept as requests
enter and leave.

It also keeps the tokens a prefix-cache match is not expected to cover (`num_uncached_tokens`,
each request's estimate taken as it enters): a router placing by the cache must not count the
cached history of every queued turn as work left to do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from disagg.engine.request import Request

__all__ = ["WaitingQueue"]


class WaitingQueue:
    def __init__(self, num_cached: Callable[[Request], int] = lambda request: 0) -> None:
        """`num_cached(request)`: prompt tokens its prefix-cache match would cover now."""
        self._queue: deque[Request] = deque()
        self._num_cached = num_cached
        self.num_tokens = 0  # sum of num_tokens over the queue
        self.num_uncached_tokens = 0  # sum of the estimates taken as requests entered

    def append(self, request: Request) -> None:
        self._queue.append(request)
        self._enter(request)

    def appendleft(self, request: Request) -> None:
        self._queue.appendleft(request)
        self._enter(request)

    def popleft(self) -> Request:
        request = self._queue.popleft()
        self._leave(request)
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self._leave(request)

    def _enter(self, request: Request) -> None:
        self.num_tokens += request.num_tokens
        request.queued_uncached_tokens = request.num_tokens - self._num_cached(request)
        self.num_uncached_tokens += request.queued_uncached_tokens

    def _leave(self, request: Request) -> None:
        self.num_tokens -= request.num_tokens
        self.num_uncached_tokens -= request.queued_uncached_tokens

    def check_integrity(self) -> None:
        """Raise if the kept token sum is stale, or a waiting request holds computed tokens
        (a head that could not start is reset, so the sum is what is left to prefill)."""
        queued = [(r.request_id, r.num_computed_tokens) for r in self._queue]
        uncached = sum(r.queued_uncached_tokens for r in self._queue)
        if (
            self.num_tokens != sum(r.num_tokens for r in self._queue)
            or self.num_uncached_tokens != uncached
            or any(computed for _, computed in queued)
        ):
            raise AssertionError(
                f"waiting queue's token sums {self.num_tokens} / {self.num_uncached_tokens} "
                f"(uncached) are stale, or a waiting request holds computed tokens: {queued[:8]}"
            )

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
