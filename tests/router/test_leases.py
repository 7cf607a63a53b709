"""Pull: P's lease on the prompt's blocks when the client leaves near the handoff, against fake
instances. Released at once while no decode instance can read it, after D's fence once D may
have the leg, kept once D may be reading (the stages of router/handoff.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from tests.router.fakes import (
    PROMPT,
    WAIT_S,
    FakeInstance,
    completion,
    default_handler,
    routed,
    run_async,
    running,
    running_router,
    sse,
    sse_response,
    wait_until,
)


async def hang_up_when(url: str, event: asyncio.Event, body: dict[str, Any] = PROMPT) -> None:
    """A client that sends `body` and goes away once `event` is set."""
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(url + "/v1/completions", json=body))
        await asyncio.wait_for(event.wait(), WAIT_S)
        task.cancel()  # closes the connection: the router's handler is cancelled
        await asyncio.gather(task, return_exceptions=True)


def test_pull_client_gone_during_prefill_leg_aborts_and_releases_it() -> None:
    """Regression: a client that left while the P leg was in flight left P's lease (made if P
    finished just then) held until it expired; the router must abort it and release it under
    the id it sent (P resolves that to its own)."""

    async def main() -> None:
        in_prefill = asyncio.Event()

        async def slow_prefill(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            in_prefill.set()
            await asyncio.sleep(WAIT_S)

        p, d = FakeInstance("prefill", handler=slow_prefill), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            await hang_up_when(url, in_prefill)
            await wait_until(lambda: p.aborts and p.releases)
        rid = p.received[0].request_id
        assert p.aborts == [rid] and p.releases == [rid]
        assert d.received == []

    run_async(main())


def test_pull_client_gone_between_prefill_answer_and_decode_releases_the_lease() -> None:
    """Regression: the client leaves after P answered but before the D leg went out (here the
    router is reading D's /load for late binding): P's lease was held until it expired."""

    async def main() -> None:
        answered = asyncio.Event()

        async def prefill_then_signal(fake: FakeInstance, request: web.Request, body: dict):
            answer = await default_handler(fake, request, body)
            asyncio.get_running_loop().call_later(0.1, answered.set)  # the answer is out
            return answer

        p = FakeInstance("prefill", handler=prefill_then_signal)
        d = FakeInstance("decode", load_delay_s=0.4)  # late binding waits for it
        async with running(p, d) as (p_url, d_url):
            cfg = {"prefill_urls": (p_url,), "decode_urls": (d_url,), "mode": "pull"}
            async with running_router(
                **cfg, policy="least_loaded", load_poll_interval_s=60.0
            ) as url:
                await hang_up_when(url, answered)
                await wait_until(lambda: p.aborts and p.releases)
        rid = p.received[0].request_id
        assert p.releases == [rid]  # remote_request_id of P's answer (the fake uses the leg id)
        assert d.received == []

    run_async(main())


def test_pull_client_gone_after_decode_started_keeps_the_lease() -> None:
    """Once D has P's params it may be reading P's blocks: P is aborted, but the lease stays
    for D's read_done (or D's own release when it drops the request)."""

    async def main() -> None:
        streaming = asyncio.Event()

        async def endless(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            resp = await sse_response(request)
            streaming.set()
            for i in range(int(WAIT_S / 0.02)):
                await resp.write(sse(completion("x", f"t{i}")))
                await asyncio.sleep(0.02)
            return resp

        p, d = FakeInstance("prefill"), FakeInstance("decode", handler=endless)
        async with routed(p, d, mode="pull") as url:
            await hang_up_when(url, streaming, {**PROMPT, "stream": True})
            await wait_until(lambda: p.aborts and d.fences)
            await asyncio.sleep(0.2)
        assert p.releases == []  # D answered that it holds the request

    run_async(main())


def test_pull_client_gone_before_decode_took_the_leg_releases_once_decode_fences_it() -> None:
    """Regression (a flaky e2e test): the client left after D's leg went out but before D's
    engine took it (D's handler still reading or tokenizing it, or the leg cut mid-send); D
    never learnt P's lease, so nobody released it for 30 s. The router now asks D to abort
    with a fence, and releases P's lease when D answers that it never held the request."""

    async def main() -> None:
        arrived = asyncio.Event()

        async def stalled(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            arrived.set()  # the leg is here; its engine never takes it
            await asyncio.sleep(WAIT_S)

        p = FakeInstance("prefill")
        d = FakeInstance("decode", handler=stalled, holds_fenced=False)
        async with routed(p, d, mode="pull") as url:
            await hang_up_when(url, arrived)
            await wait_until(lambda: p.releases)
        rid = p.received[0].request_id
        assert d.fences == [rid] and p.releases == [rid]

    run_async(main())


def test_pull_release_waits_for_a_signed_fenced_answer() -> None:
    """ "fenced" counts only in D's signed answer to this call: an unsigned one (a forger on
    the path) could free blocks D is reading."""

    async def main() -> None:
        arrived = asyncio.Event()

        async def stalled(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            arrived.set()
            await asyncio.sleep(WAIT_S)

        p = FakeInstance("prefill")
        d = FakeInstance("decode", handler=stalled, holds_fenced=False, signs_answers=False)
        async with routed(p, d, mode="pull") as url:
            await hang_up_when(url, arrived)
            await wait_until(lambda: d.fences)
            await asyncio.sleep(0.3)
        assert p.releases == []

    run_async(main())
