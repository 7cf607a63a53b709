"""Admission against a fake instance: a bounded queue in front of the flows (429 when full,
503 past the queue timeout)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from tests.router.fakes import (
    PROMPT,
    WAIT_S,
    FakeInstance,
    default_handler,
    metric,
    post,
    run_async,
    running,
    running_router,
    wait_until,
)


@asynccontextmanager
async def one_slot_router(**cfg: Any) -> AsyncIterator[tuple[FakeInstance, asyncio.Event, str]]:
    """A router with one admission slot (and `cfg`) in front of one instance that answers only
    once the event is set; yields (instance, event, router URL)."""
    release = asyncio.Event()

    async def held(fake: FakeInstance, request: web.Request, body: dict) -> Any:
        await asyncio.wait_for(release.wait(), WAIT_S)
        return await default_handler(fake, request, body)

    d = FakeInstance("both", handler=held)
    async with running(d) as (d_url,):
        async with running_router(decode_urls=(d_url,), max_concurrent_requests=1, **cfg) as url:
            yield d, release, url


def test_admission_queues_up_to_its_bound_then_refuses_with_429() -> None:
    async def main() -> None:
        async with one_slot_router(max_queued_requests=1) as (d, release, url):
            first = asyncio.create_task(post(url, PROMPT))
            await wait_until(lambda: d.received)  # in flight
            second = asyncio.create_task(post(url, PROMPT))
            await asyncio.sleep(0.1)  # queued behind the first
            status, answer = await post(url, PROMPT)  # the queue is full
            assert status == 429
            assert set(answer["error"]) == {"message", "type", "param", "code"}
            assert len(d.received) == 1  # the queued one waits for the slot
            release.set()
            assert (await first)[0] == 200 and (await second)[0] == 200
            refused = 'disagg_router_admission_refused_total{reason="queue_full"}'
            assert await metric(url, refused) == 1

    run_async(main())


def test_admission_wait_longer_than_the_queue_timeout_is_503() -> None:
    async def main() -> None:
        async with one_slot_router(queue_timeout_s=0.3) as (d, release, url):
            first = asyncio.create_task(post(url, PROMPT))
            await wait_until(lambda: d.received)
            started = time.monotonic()
            status, answer = await post(url, PROMPT)
            assert status == 503 and "queue" in answer["error"]["message"]
            assert 0.3 <= time.monotonic() - started < 2.0
            release.set()
            assert (await first)[0] == 200
            timed_out = 'disagg_router_admission_refused_total{reason="queue_timeout"}'
            assert await metric(url, timed_out) == 1
        assert len(d.received) == 1

    run_async(main())
