"""Router flows against fake P and D servers: what each leg receives, in which order, and what
the client gets back (aggregated, pull, push; streaming; failures; disconnects)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from tests.router.fakes import (
    PROMPT,
    WAIT_S,
    FakeInstance,
    answer_after_abort,
    completion,
    default_handler,
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


def test_aggregated_stream_is_relayed_chunk_by_chunk() -> None:
    async def main() -> None:
        release, sent_last = asyncio.Event(), asyncio.Event()

        async def slow_stream(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            resp = await sse_response(request)
            await resp.write(sse(completion("x", "first")))
            await asyncio.wait_for(release.wait(), WAIT_S)  # the client must see "first" first
            await resp.write(sse(completion("x", "last")) + b"data: [DONE]\n\n")
            sent_last.set()
            return resp

        d = FakeInstance("both", handler=slow_stream)
        async with running(d) as (d_url,), running_router(decode_urls=(d_url,)) as url:
            async with aiohttp.ClientSession() as session:
                body = {**PROMPT, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Request-Id"].startswith("cmpl-")
                    first = await asyncio.wait_for(read_events(resp, 1), WAIT_S)
                    assert json.loads(first[0])["choices"][0]["text"] == "first"
                    assert not sent_last.is_set()
                    release.set()
                    rest = await read_events(resp)
        assert [json.loads(e)["choices"][0]["text"] for e in rest[:-1]] == ["last"]
        assert rest[-1] == "[DONE]"
        assert d.received[0].request_id == resp.headers["X-Request-Id"]
        assert d.received[0].body == body  # aggregated: the request as the client sent it

    run_async(main())


def test_pull_is_prefill_then_decode_with_prefill_params() -> None:
    async def main() -> None:
        p, d = FakeInstance("prefill"), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            body = {**PROMPT, "min_tokens": 2}
            status, answer = await post(url, body)
        assert status == 200, answer
        (p_leg,), (d_leg,) = p.received, d.received
        assert p_leg.body["max_tokens"] == 1 and p_leg.body["stream"] is False
        assert "stream_options" not in p_leg.body and "min_tokens" not in p_leg.body
        assert p_leg.kv == {"do_remote_decode": True, "connector": "pull"}
        assert d_leg.at_s > p_leg.at_s
        assert d_leg.body["max_tokens"] == 8 and d_leg.body["min_tokens"] == 2
        assert d_leg.kv["remote_block_ids"] == [3, 4] and d_leg.kv["do_remote_prefill"] is True
        assert d_leg.kv["connector"] == "pull"
        assert p_leg.request_id == d_leg.request_id == d_leg.kv["remote_request_id"]
        assert p_leg.request_id.startswith("cmpl-")
        # P's fields fill in, D's win where both are set (transfer_s).
        breakdown = answer["disagg"]["breakdown"]
        assert breakdown == {
            "queue_s": 0.1,
            "prefill_s": 0.2,
            "transfer_s": 0.3,
            "first_step_s": 0.05,
        }

    run_async(main())


def test_pull_chat_stream_limits_prefill_and_merges_breakdown_into_final_chunk() -> None:
    async def main() -> None:
        p, d = FakeInstance("prefill"), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 5,
                "stream": True,
            }
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.headers["X-Request-Id"].startswith("chatcmpl-")
                    events = await asyncio.wait_for(read_events(resp), WAIT_S)
        p_body = p.received[0].body
        assert p_body["max_tokens"] == 1 and "max_completion_tokens" not in p_body
        assert d.received[0].body["max_completion_tokens"] == 5
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert final["disagg"]["breakdown"]["queue_s"] == 0.1
        assert final["disagg"]["breakdown"]["transfer_s"] == 0.3

    run_async(main())


def test_pull_prefill_error_is_returned_and_decode_never_called() -> None:
    async def main() -> None:
        error, reject = _refusing("prompt too long", 400)

        p, d = FakeInstance("prefill", handler=reject), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            status, answer = await post(url, PROMPT)
        assert (status, answer) == (400, error)
        assert d.received == []

    run_async(main())


def test_pull_prefill_connection_dropped_is_502() -> None:
    async def hang_up(fake: FakeInstance, request: web.Request, body: dict) -> Any:
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(WAIT_S)

    async def main() -> None:
        p, d = FakeInstance("prefill", handler=hang_up), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            status, answer = await post(url, PROMPT)
        assert status == 502
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert d.received == []

    run_async(main())


def test_pull_prefill_answer_with_invalid_kv_params_is_502_and_its_lease_released() -> None:
    """P's kv_transfer_params are checked at the router (KVTransferParams.from_dict): a bad
    one never reaches a decode instance, and P's lease is released as for none at all."""

    async def bad_params(fake: FakeInstance, request: web.Request, body: dict) -> Any:
        params = {"do_remote_prefill": True, "remote_block_ids": [-1]}
        return web.json_response(completion("p", "A", kv_transfer_params=params))

    async def main() -> None:
        p, d = FakeInstance("prefill", handler=bad_params), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            status, answer = await post(url, PROMPT)
            await wait_until(lambda: p.releases)
        assert status == 502 and "invalid kv_transfer_params" in answer["error"]["message"]
        assert d.received == []
        rid = p.received[0].request_id
        assert (p.aborts, p.releases) == ([rid], [rid])

    run_async(main())


def test_pull_least_loaded_picks_decode_from_load_read_after_prefill() -> None:
    async def main() -> None:
        d1 = FakeInstance("decode", load={"num_running": 0})
        d2 = FakeInstance("decode", load={"num_running": 6, "num_waiting": 2})
        # Loads the decode instances report once each prefill is under way.
        loads_during_prefill = [({"num_running": 9}, {"num_running": 1}), ({}, {"num_running": 5})]

        async def prefill_then_change_loads(fake: FakeInstance, request: web.Request, body: dict):
            # Only a /load read after P's answer sees this: late binding.
            d1.load, d2.load = loads_during_prefill.pop(0)
            return await default_handler(fake, request, body)

        p = FakeInstance("prefill", handler=prefill_then_change_loads)
        async with running(p, d1, d2) as (p_url, d1_url, d2_url):
            cfg: dict[str, Any] = {"prefill_urls": (p_url,), "decode_urls": (d1_url, d2_url)}
            cfg |= {"mode": "pull", "policy": "least_loaded", "load_poll_interval_s": 60.0}
            async with running_router(**cfg) as url:
                assert (await post(url, PROMPT))[0] == 200
                assert (await post(url, PROMPT))[0] == 200
        assert len(d2.received) == 1 and len(d1.received) == 1
        assert d2.received[0].at_s < d1.received[0].at_s

    run_async(main())


def _refusing(message: str, status: int) -> tuple[dict[str, Any], Any]:
    """An OpenAI-shaped error and a fake's handler that answers it with HTTP `status`."""
    error = {"error": {"message": message, "type": "BadRequestError", "code": 400}}

    async def reject(fake: FakeInstance, request: web.Request, body: dict) -> Any:
        return web.json_response(error, status=status)

    return error, reject


def _push_cluster(p_handler: Any = None, d_handler: Any = None) -> tuple[FakeInstance, ...]:
    p = FakeInstance("prefill", handler=p_handler, kv_info={"connector": "push"})
    return p, FakeInstance("decode", handler=d_handler, kv_info={"connector": "push"})


def test_push_sends_both_legs_concurrently_with_one_transfer_id() -> None:
    async def main() -> None:
        saw_decode: list[bool] = []

        async def wait_for_decode(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            # Sequential dispatch would never let D arrive while P is still working.
            try:
                await asyncio.wait_for(d.arrived.wait(), WAIT_S)
                saw_decode.append(True)
            except TimeoutError:
                saw_decode.append(False)
            breakdown = {"queue_s": 0.1, "transfer_s": 9.0}
            return web.json_response(completion("p", "A", disagg={"breakdown": breakdown}))

        p, d = _push_cluster(p_handler=wait_for_decode)
        async with routed(p, d, mode="push") as url:
            async with aiohttp.ClientSession() as session:
                body = {**PROMPT, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    events = await asyncio.wait_for(read_events(resp), WAIT_S)
        assert saw_decode == [True]
        p_kv, d_kv = p.received[0].kv, d.received[0].kv
        assert p_kv["do_remote_decode"] is True and p_kv["connector"] == "push"
        assert d_kv["do_remote_prefill"] is True and d_kv["connector"] == "push"
        assert p_kv["transfer_id"] == d_kv["transfer_id"] and len(d_kv["transfer_id"]) == 32
        port = int(p.url.rsplit(":", 1)[1])
        assert (d_kv["remote_engine_id"], d_kv["remote_port"]) == (f"prefill-{port}", port + 1)
        assert d_kv["remote_host"] == "127.0.0.1"
        assert p.received[0].request_id == d.received[0].request_id
        assert p.received[0].body["max_tokens"] == 1 and d.received[0].body["max_tokens"] == 8
        final = json.loads(events[-2])["disagg"]["breakdown"]
        assert final == {"queue_s": 0.1, "transfer_s": 0.3, "first_step_s": 0.05}

    run_async(main())


def test_push_prefill_failure_mid_stream_ends_stream_with_error_and_aborts_decode() -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def stream_until_aborted(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            resp = await sse_response(request)
            await resp.write(sse(completion("x", "first")))
            started.set()
            await asyncio.wait_for(fake.aborted.wait(), WAIT_S)
            return resp

        async def fail_after_decode_started(fake: FakeInstance, request: web.Request, body: dict):
            await asyncio.wait_for(started.wait(), WAIT_S)
            error = {"error": {"message": "KV write failed", "type": "server_error", "code": 500}}
            return web.json_response(error, status=500)

        p, d = _push_cluster(fail_after_decode_started, stream_until_aborted)
        async with routed(p, d, mode="push") as url:
            async with aiohttp.ClientSession() as session:
                body = {**PROMPT, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    events = await asyncio.wait_for(read_events(resp), WAIT_S)
            await wait_until(lambda: d.aborts)
        assert json.loads(events[0])["choices"][0]["text"] == "first"
        assert json.loads(events[1])["error"]["message"] == "KV write failed"
        assert events[2:] == ["[DONE]"]
        assert d.aborts == [d.received[0].request_id]
        assert p.aborts == []

    run_async(main())


def test_push_prefill_failure_before_decode_answers_returns_error_and_aborts_decode() -> None:
    async def main() -> None:
        async def unavailable(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            return web.Response(status=503, text="overloaded")

        p, d = _push_cluster(unavailable, answer_after_abort("x", "never seen"))
        async with routed(p, d, mode="push") as url:
            status, answer = await post(url, PROMPT)
            await wait_until(lambda: d.aborts)
        assert status == 503
        error = answer["error"]  # a plain-text answer, wrapped: the code is a string, as OpenAI's
        assert (error["message"], error["code"]) == ("overloaded", "service_unavailable")
        assert d.aborts == [p.received[0].request_id]

    run_async(main())


def test_push_decode_failure_aborts_prefill() -> None:
    async def main() -> None:
        async def refuse(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            return web.json_response({"error": {"message": "no blocks", "code": 429}}, status=429)

        p, d = _push_cluster(answer_after_abort("p", "A"), refuse)
        async with routed(p, d, mode="push") as url:
            status, answer = await post(url, PROMPT)
            await wait_until(lambda: p.aborts)
        assert (status, answer["error"]["message"]) == (429, "no blocks")
        assert p.aborts == [d.received[0].request_id]

    run_async(main())


def test_push_client_disconnect_closes_decode_and_aborts_prefill() -> None:
    async def main() -> None:
        decode_gone = asyncio.Event()

        async def endless(fake: FakeInstance, request: web.Request, body: dict) -> Any:
            resp = await sse_response(request)
            try:
                for i in range(int(WAIT_S / 0.02)):
                    await resp.write(sse(completion("x", f"t{i}")))
                    await asyncio.sleep(0.02)
            except (asyncio.CancelledError, ConnectionResetError):
                decode_gone.set()  # the router dropped the connection
                raise
            return resp

        p, d = _push_cluster(answer_after_abort("p", "A"), endless)
        async with routed(p, d, mode="push") as url:
            async with aiohttp.ClientSession() as session:
                body = {**PROMPT, "stream": True}
                resp = await session.post(url + "/v1/completions", json=body)
                await asyncio.wait_for(read_events(resp, 2), WAIT_S)
                resp.close()  # the client goes away mid-stream
            await asyncio.wait_for(decode_gone.wait(), WAIT_S)
            await wait_until(lambda: p.aborts)
        assert p.aborts == [d.received[0].request_id]

    run_async(main())


def test_aggregated_upstream_4xx_passes_through_unchanged() -> None:
    async def main() -> None:
        error, reject = _refusing("bad temperature", 422)

        d = FakeInstance("both", handler=reject)
        async with running(d) as (d_url,), running_router(decode_urls=(d_url,)) as url:
            assert await post(url, {**PROMPT, "stream": True}) == (422, error)

    run_async(main())
