"""Admission in front of the flows: at most `max_in_flight` client requests at once; up to
`max_queued` more wait for a slot in arrival order, each for at most `timeout_s`. Refusals are
RouteErrors in OpenAI's shape: 429 when the queue is full, 503 when a wait runs out.

Must not route or proxy (flows.py, legs.py); it only counts slots.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable

from disagg.router.relay import RouteError

__all__ = ["Admission"]


class Admission:
    def __init__(
        self,
        max_in_flight: int,
        max_queued: int,
        timeout_s: float,
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        """`on_refused(reason)` is told of each refusal: "queue_full" or "queue_timeout"."""
        self.max_in_flight = max_in_flight  # 0 = no limit
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._on_refused = on_refused
        self.num_in_flight = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body of the `async with`; raises RouteError when refused."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if not self.max_in_flight or (
            self.num_in_flight < self.max_in_flight and not self._waiting
        ):
            self.num_in_flight += 1
            return
        if len(self._waiting) >= self.max_queued:
            self._on_refused("queue_full")
            raise RouteError.of(429, f"too many requests: {self.max_queued} already queued")
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            self._give_up(turn)
            if isinstance(exc, TimeoutError):
                self._on_refused("queue_timeout")
                message = f"no free slot within the queue timeout ({self.timeout_s:g} s)"
                raise RouteError.of(503, message) from exc
            raise

    def _give_up(self, turn: asyncio.Future[None]) -> None:
        """A waiter left (timeout, client gone). If a slot was handed to it meanwhile, it
        passes that slot on; otherwise it leaves the queue."""
        if turn.done() and not turn.cancelled():
            self._release()
        else:
            turn.cancel()
            self._waiting.remove(turn)

    def _release(self) -> None:
        """A slot is free: hand it to the longest waiter (in flight stays the same), or count
        it free."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.num_in_flight -= 1
