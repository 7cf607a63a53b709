"""The router under failure, against fake instances: recompute with no healthy prefill
instance, retries of legs that never reached their instance, and the circuit breaker."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from tests.router.fakes import (
    PROMPT,
    WAIT_S,
    FakeInstance,
    completion,
    default_handler,
    metric,
    post,
    read_events,
    routed,
    run_async,
    running,
    running_router,
    sse,
    sse_response,
    wait_until,
)

# ---- recompute with no healthy prefill instance ---------------------------------------------


def test_recompute_serves_on_decode_when_no_prefill_instance_is_healthy() -> None:
    """Regression: with `--failure-policy recompute` and every prefill instance unhealthy, the
    router answered 503 "no healthy prefill instance" while a decode instance could serve."""

    async def main() -> None:
        for mode in ("pull", "push"):
            p = FakeInstance("prefill", health_status=503, kv_info={"connector": mode})
            d = FakeInstance("decode", kv_info={"connector": mode})
            async with running(p, d) as (p_url, d_url):
                cfg = {"prefill_urls": (p_url,), "decode_urls": (d_url,), "mode": mode}
                async with running_router(**cfg, failure_policy="recompute") as url:
                    status, answer = await post(url, PROMPT)
                    assert await metric(url, "disagg_router_recomputed_total") == 1
            assert status == 200, answer
            assert p.received == [] and d.received[0].body == PROMPT  # whole, no kv params

    run_async(main())


def test_no_healthy_prefill_instance_is_still_503_under_policy_fail() -> None:
    async def main() -> None:
        p, d = FakeInstance("prefill", health_status=503), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            status, answer = await post(url, PROMPT)
        assert status == 503 and "prefill" in answer["error"]["message"]
        assert d.received == []

    run_async(main())


# ---- retries of legs that never reached their instance --------------------------------------


def test_a_leg_to_an_instance_gone_a_moment_ago_is_retried_on_another() -> None:
    """Regression: a leg to an instance killed a moment before (the router still had it for
    healthy) was answered 502 "cannot reach"; it never reached the instance, so it is sent to
    another one, after a backoff, for every flow and leg."""

    async def aggregated() -> None:
        d1, d2 = FakeInstance("both"), FakeInstance("both")
        async with running(d1, d2) as urls:
            cfg = {"decode_urls": tuple(urls), "retry_backoff_s": 0.2}
            async with running_router(**cfg) as url:
                await d1.die_between_probes()  # round robin sends the first request to d1
                started = time.monotonic()
                status, answer = await post(url, PROMPT)
                assert time.monotonic() - started >= 0.2  # the backoff
                assert await metric(url, 'disagg_router_retries_total{leg="aggregated"}') == 1
        assert status == 200, answer
        assert len(d2.received) == 1

    async def pull_prefill() -> None:
        p1, p2, d = FakeInstance("prefill"), FakeInstance("prefill"), FakeInstance("decode")
        async with running(p1, p2, d) as (p1_url, p2_url, d_url):
            cfg = {"prefill_urls": (p1_url, p2_url), "decode_urls": (d_url,), "mode": "pull"}
            async with running_router(**cfg) as url:
                await p1.die_between_probes()
                status, answer = await post(url, PROMPT)
                assert await metric(url, 'disagg_router_retries_total{leg="prefill"}') == 1
        assert status == 200, answer
        assert len(p2.received) == 1 and len(d.received) == 1
        assert p2.aborts == [] and p2.releases == []

    async def pull_decode() -> None:
        p, d1, d2 = FakeInstance("prefill"), FakeInstance("decode"), FakeInstance("decode")
        async with running(p, d1, d2) as (p_url, d1_url, d2_url):
            cfg = {"prefill_urls": (p_url,), "decode_urls": (d1_url, d2_url), "mode": "pull"}
            async with running_router(**cfg) as url:
                await d1.die_between_probes()
                status, answer = await post(url, PROMPT)
                assert await metric(url, 'disagg_router_retries_total{leg="decode"}') == 1
        assert status == 200, answer
        assert d2.received[0].kv["remote_block_ids"] == [3, 4]  # P's lease, handed on
        assert p.aborts == [] and p.releases == []  # the lease is D2's to read

    async def main() -> None:
        await aggregated()
        await pull_prefill()
        await pull_decode()

    run_async(main(), timeout_s=40.0)


def test_push_retry_pairs_prefill_with_a_newly_chosen_decode() -> None:
    """Push binds P to one D (transfer id, D's engine id): when D's leg never reached D, the
    pair is sent again under a fresh transfer id with a newly chosen D, and the first P leg,
    which P may be prefilling, is aborted."""

    async def main() -> None:
        push = {"connector": "push"}
        p = FakeInstance("prefill", kv_info=push)
        d1, d2 = FakeInstance("decode", kv_info=push), FakeInstance("decode", kv_info=push)
        async with running(p, d1, d2) as (p_url, d1_url, d2_url):
            cfg = {"prefill_urls": (p_url,), "decode_urls": (d1_url, d2_url), "mode": "push"}
            async with running_router(**cfg) as url:
                await d1.die_between_probes()
                status, answer = await post(url, PROMPT)
                await wait_until(lambda: p.aborts)
        assert status == 200, answer
        first, second = p.received
        (d_leg,) = d2.received
        assert first.kv["transfer_id"] != second.kv["transfer_id"] == d_leg.kv["transfer_id"]
        port = int(d2.url.rsplit(":", 1)[1])
        assert second.kv["remote_engine_id"] == f"decode-{port}"  # P is paired with D2
        assert p.aborts == [first.request_id] and second.request_id == d_leg.request_id

    run_async(main())


def test_no_retry_once_the_budget_is_spent() -> None:
    """With a budget of 0 a refused leg is the client's 502, though another instance is up."""

    async def main() -> None:
        d1, d2 = FakeInstance("both"), FakeInstance("both")
        async with running(d1, d2) as urls:
            async with running_router(decode_urls=tuple(urls), max_retries=0) as url:
                await d1.die_between_probes()
                status, answer = await post(url, PROMPT)
                assert status == 502 and "cannot reach" in answer["error"]["message"]
                assert d2.received == []
                assert (await post(url, PROMPT))[0] == 200  # the dead one is out of the pool
        assert len(d2.received) == 1

    run_async(main())


def test_a_leg_that_broke_after_bytes_were_relayed_is_not_retried() -> None:
    async def main() -> None:
        async def break_mid_stream(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            resp = await sse_response(request)
            await resp.write(sse(completion("x", "first")))
            assert request.transport is not None
            request.transport.close()
            return resp

        d1, d2 = FakeInstance("both", handler=break_mid_stream), FakeInstance("both")
        async with running(d1, d2) as urls, running_router(decode_urls=tuple(urls)) as url:
            async with aiohttp.ClientSession() as session:
                body = {**PROMPT, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    events = await asyncio.wait_for(read_events(resp), WAIT_S)
            assert await metric(url, 'disagg_router_retries_total{leg="aggregated"}') == 0
        assert json.loads(events[0])["choices"][0]["text"] == "first"
        assert "error" in json.loads(events[1]) and d2.received == []

    run_async(main())


# ---- circuit breaker ------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_then_probes_after_the_cooldown() -> None:
    """D1 answers /health but fails every leg (503): after two failures in a row its breaker
    opens and the policy sends it nothing; after the cooldown one leg probes it, and once it
    serves again it takes its share."""

    async def main() -> None:
        is_broken = True

        async def flaky(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            if is_broken:
                return web.json_response({"error": {"message": "engine dead"}}, status=503)
            return await default_handler(fake, request, body)

        d1, d2 = FakeInstance("both", handler=flaky), FakeInstance("both")
        async with running(d1, d2) as urls:
            cfg = {"decode_urls": tuple(urls), "breaker_failures": 2, "breaker_cooldown_s": 0.5}
            async with running_router(**cfg) as url:
                statuses = [(await post(url, PROMPT))[0] for _ in range(6)]
                assert statuses == [503, 200, 503, 200, 200, 200]  # open after the 2nd failure
                opened = f'disagg_router_breaker_opened_total{{role="both",url="{d1.url}"}}'
                assert await metric(url, opened) == 1
                is_broken = False
                await asyncio.sleep(0.6)  # the cooldown
                assert [(await post(url, PROMPT))[0] for _ in range(4)] == [200] * 4
        assert len(d1.received) == 2 + 2  # two failures, then the probe and its share
        assert len(d2.received) == 4 + 2

    run_async(main())
