"""The router in front of vLLM instances (NixlPushConnector for push, NixlConnector for pull),
against fakes that speak exactly what vLLM reads and answers (tests/router/vllm_fake.py).

Each test ends with P's leases checked: vLLM has no route to release one, so whatever the router
does on a failure path must leave none behind but those its own lease ends."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from disagg.router.identity import VLLMIdentity, parse_side_channel
from disagg.router.vllm_load import load_from_vllm_metrics
from disagg.router.vllm_params import VLLMParams
from tests.router.fakes import (
    FakeInstance,
    post,
    read_events,
    run_async,
    running,
    running_router,
    wait_until,
)
from tests.router.vllm_fake import Fabric, FakeVLLM, expected_text

PUSH_D_KEYS = {"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host",
               "remote_port", "tp_size", "remote_request_id", "remote_block_ids"}  # fmt: skip


@asynccontextmanager
async def vllm_pair(
    connector: str = "NixlPushConnector", **p_fields: Any
) -> AsyncIterator[tuple[FakeVLLM, FakeVLLM]]:
    fabric = Fabric()
    p = FakeVLLM(fabric, connector=connector, engine_id="P", **p_fields)
    d = FakeVLLM(fabric, connector=connector, engine_id="D")
    await p.start()
    await d.start()
    try:
        yield p, d
    finally:
        await p.stop()
        await d.stop()


@asynccontextmanager
async def router_over(p: FakeVLLM, d: FakeVLLM, mode: str, **cfg: Any) -> AsyncIterator[str]:
    async with running_router(mode=mode, prefill_urls=(p.url,), decode_urls=(d.url,), **cfg) as url:
        await _wait_ready(url)
        yield url


async def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 5.0
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
            assert time.monotonic() < deadline, "router never ready"
            await asyncio.sleep(0.02)


async def instances(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/instances") as resp:
        return await resp.json()


def body(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": f"request {i}", "max_tokens": 6, "temperature": 0, **extra}


async def stream_text(url: str, request: dict[str, Any]) -> tuple[int, str, list[str]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json={**request, "stream": True}) as resp,
    ):
        events = await read_events(resp)
    texts = [json.loads(e)["choices"][0]["text"] for e in events if e.startswith("{") and
             "choices" in e]  # fmt: skip
    return resp.status, "".join(texts), events


# ---- push ------------------------------------------------------------------------------------


def test_push_drives_vllm_push_protocol_with_both_legs_at_once() -> None:
    """16 concurrent requests through a push router to vLLM push instances: every answer is the
    text a whole request gets, each pair's legs carry one X-Request-Id (vLLM pairs them by it),
    D's params are exactly what vLLM's push scheduler reads, D's leg left before P answered
    (concurrent dispatch), and P holds no lease after."""

    async def main() -> None:
        async with vllm_pair(prefill_s=0.2) as (p, d), router_over(p, d, "push") as url:
            kinds = {inst["url"]: inst["engine"] for inst in await instances(url)}
            assert kinds == {p.url: "vllm", d.url: "vllm"}
            requests = [body(i) for i in range(16)]
            answers = await asyncio.gather(
                *(post(url, r) for r in requests[:8]),
                *(stream_text(url, r) for r in requests[8:]),
            )
            for r, (status, answer, *_) in zip(requests, answers, strict=True):
                text = answer if isinstance(answer, str) else answer["choices"][0]["text"]
                assert status == 200 and text == "".join(expected_text(r, 6)), answer
            p_legs = {h["x-request-id"]: (b, at) for _, h, b, at in p.received}
            assert len(p_legs) == 16 and len(d.received) == 16
            for _, headers, d_body, d_at_s in d.received:
                p_body, _ = p_legs[headers["x-request-id"]]  # the same id on both legs
                assert p_body["kv_transfer_params"] == VLLMParams.prefill().to_sparse_dict()
                assert p_body["max_tokens"] == 1 and p_body["stream"] is False
                params = d_body["kv_transfer_params"]
                assert set(params) == PUSH_D_KEYS and params["remote_engine_id"] == "P"
                assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.side_port)
                assert params["remote_request_id"] == headers["x-request-id"]
                assert d_at_s < p.answered_s[headers["x-request-id"]]  # sent before P was done
            p.expire_leases()
            assert not p.leases and p.num_expired == 0
            posts = [r for r in p.other_routes + d.other_routes if r.startswith("POST")]
            assert not posts  # no /v1/abort, /kv/release: vLLM has neither

    run_async(main())


def test_push_takes_a_declared_side_channel_when_vllm_serves_no_server_info() -> None:
    async def main() -> None:
        async with vllm_pair(dev_mode=False) as (p, d):
            spec = f"{p.url}=P@127.0.0.1:{p.side_port}"
            async with router_over(p, d, "push", vllm_side_channels=(spec,)) as url:
                status, answer = await post(url, body(1))
                assert status == 200, answer
            p.expire_leases()
            assert not p.leases

    run_async(main())


def test_push_refuses_a_vllm_prefill_whose_side_channel_is_unknown() -> None:
    """No /server_info and nothing declared: the router cannot name P on D's leg, so P takes
    no work, and /instances says why and what to do."""

    async def main() -> None:
        async with (
            vllm_pair(dev_mode=False) as (p, d),
            running_router(mode="push", prefill_urls=(p.url,), decode_urls=(d.url,)) as url,
        ):
            await asyncio.sleep(0.3)  # a few health probes
            views = {v["url"]: v for v in await instances(url)}
            assert not views[p.url]["healthy"]
            assert "--vllm-side-channel" in views[p.url]["problem"]
            status, answer = await post(url, body(1))
            assert status == 503 and "prefill" in answer["error"]["message"]
            assert not p.received and not d.received

    run_async(main())


def test_a_vllm_instance_with_the_wrong_connector_is_refused() -> None:
    async def main() -> None:
        async with (
            vllm_pair(connector="NixlConnector") as (p, d),
            running_router(mode="push", prefill_urls=(p.url,), decode_urls=(d.url,)) as url,
        ):
            await asyncio.sleep(0.3)
            problems = [v["problem"] or "" for v in await instances(url)]
            assert all("NixlPushConnector" in text for text in problems), problems

    run_async(main())


def test_push_decode_killed_mid_stream_answers_every_client_and_leaks_no_lease() -> None:
    """D dies while streaming 4 answers: each client gets an error event at once; requests
    sent after its death are refused quickly; P's leases for them end with their lease."""

    async def main() -> None:
        async with (
            vllm_pair(lease_s=1.0) as (p, d),
            router_over(p, d, "push", max_retries=0) as url,
        ):
            d.token_s = 0.2
            streams = [asyncio.create_task(stream_text(url, body(i, max_tokens=50)))
                       for i in range(4)]  # fmt: skip
            await wait_until(lambda: len(d.received) == 4 and not d.fabric.writes, 5.0)
            await asyncio.sleep(0.3)  # mid-stream
            killed_s = time.monotonic()
            await d.stop()
            results = await asyncio.wait_for(asyncio.gather(*streams), 10.0)
            assert time.monotonic() - killed_s < 5.0
            for status, text, events in results:
                assert status == 200 and text and any('"error"' in e for e in events), events
            after = await asyncio.gather(*(post(url, body(10 + i)) for i in range(3)))
            assert all(status >= 500 for status, _ in after), after
            await asyncio.sleep(p.lease_s + 0.2)
            p.expire_leases()
            assert not p.leases

    run_async(main(), timeout_s=30.0)


def test_push_prefill_failure_cuts_the_decode_leg() -> None:
    """P answers 500: the client gets P's error, and D's leg (waiting for a WRITE that will
    never come) is dropped, which is how vLLM's request is aborted."""

    async def main() -> None:
        async with vllm_pair(prefill_status=500) as (p, d), router_over(p, d, "push") as url:
            status, answer = await post(url, body(1))
            assert status == 500 and answer["error"]["message"] == "prefill failed"
            await wait_until(lambda: len(d.aborted) == 1)
            assert not d.fabric.registrations

    run_async(main())


def test_a_client_leaving_during_prefill_aborts_both_vllm_legs() -> None:
    async def main() -> None:
        async with vllm_pair(prefill_s=2.0) as (p, d), router_over(p, d, "push") as url:
            task = asyncio.create_task(post(url, body(1)))
            await wait_until(lambda: p.received and d.received)
            task.cancel()
            await wait_until(lambda: len(p.aborted) == 1 and len(d.aborted) == 1)
            assert not p.leases and not d.fabric.registrations

    run_async(main())


# ---- pull ------------------------------------------------------------------------------------


def test_pull_relays_vllm_prefill_params_to_decode_as_written() -> None:
    async def main() -> None:
        async with vllm_pair(connector="NixlConnector") as (p, d), router_over(p, d, "pull") as url:
            status, answer = await post(url, body(3))
            assert status == 200 and answer["choices"][0]["text"] == "".join(
                expected_text(body(3), 6)
            )
            ((_, _, d_body, _),) = d.received
            params = d_body["kv_transfer_params"]
            assert params["remote_block_ids"] == [[1, 2]] and params["transfer_mode"] == "pull"
            assert params["tp_size"] == 1 and params["remote_request_id"].startswith("cmpl-")
            assert not p.leases  # D read them

    run_async(main())


def test_pull_never_sends_decode_a_leg_that_would_kill_its_engine() -> None:
    """A prefill answer lacking `remote_request_id` would kill vLLM's decode engine core (a
    KeyError in its connector): the router answers 502 and D never sees the leg."""

    async def main() -> None:
        async with vllm_pair(connector="NixlConnector") as (p, d), router_over(p, d, "pull") as url:
            original = p._prefill

            async def without_request_id(*args: Any) -> Any:
                resp = await original(*args)
                doc = json.loads(resp.body)
                del doc["kv_transfer_params"]["remote_request_id"]
                resp.body = json.dumps(doc).encode()
                return resp

            p._prefill = without_request_id  # type: ignore[method-assign]
            status, answer = await post(url, body(1))
            assert status == 502 and "remote_request_id" in answer["error"]["message"]
            assert not d.received and not d.is_dead

    run_async(main())


def test_one_router_drives_one_engine() -> None:
    """Our prefill instance and a vLLM decode instance cannot form a pair: one of them is
    kept out, and /instances says why; `--engine vllm` refuses ours outright."""

    async def main() -> None:
        fabric = Fabric()
        ours, theirs = FakeInstance("prefill", kv_info={"connector": "push"}), FakeVLLM(fabric)
        await theirs.start()
        try:
            async with (
                running(ours) as (p_url,),
                running_router(
                    mode="push", prefill_urls=(p_url,), decode_urls=(theirs.url,)
                ) as url,
            ):
                await asyncio.sleep(0.3)  # a few health probes
                problems = [v["problem"] for v in await instances(url) if v["problem"]]
                assert len(problems) == 1 and "one router per kind" in problems[0], problems
            async with (
                running(ours) as (p_url,),
                running_router(
                    mode="push", engine="vllm", prefill_urls=(p_url,), decode_urls=(theirs.url,)
                ) as url,
            ):
                await asyncio.sleep(0.3)
                views = {v["url"]: v for v in await instances(url)}
                assert "--engine vllm" in views[p_url]["problem"]
                assert not views[p_url]["healthy"] and views[theirs.url]["healthy"]
        finally:
            await theirs.stop()

    run_async(main())


def test_least_loaded_ranks_vllm_instances_by_their_gauges() -> None:
    """vLLM's /load is not ours: the router reads its /metrics gauges, so a decode instance
    reporting running requests gets none of the new ones."""

    async def main() -> None:
        async with vllm_pair(connector="NixlConnector") as (p, d):
            busy = FakeVLLM(d.fabric, connector="NixlConnector", engine_id="D2", num_running=5)
            await busy.start()
            try:
                async with running_router(
                    mode="pull", policy="least_loaded", prefill_urls=(p.url,),
                    decode_urls=(busy.url, d.url),
                ) as url:  # fmt: skip
                    await _wait_ready(url)
                    for i in range(4):
                        status, _ = await post(url, body(i))
                        assert status == 200
                assert len(d.received) == 4 and not busy.received
            finally:
                await busy.stop()

    run_async(main())


def test_vllm_metrics_make_a_load() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="200"} 1.0',
    ])  # fmt: skip
    load = load_from_vllm_metrics(text)
    assert (load.num_running, load.num_waiting) == (3, 2)
    assert (load.num_free_blocks, load.num_total_blocks) == (150, 200)
    with pytest.raises(ValueError, match="num_requests_waiting"):
        load_from_vllm_metrics(text.replace("num_requests_waiting", "x"))
    with pytest.raises(ValueError, match="block count"):
        load_from_vllm_metrics(text.replace("num_gpu_blocks", "x"))


# ---- identity -------------------------------------------------------------------------------


def test_parse_side_channel() -> None:
    url, found = parse_side_channel("http://h:8100=P-1@10.0.0.2:5600,tp=2")
    assert url == "http://h:8100"
    assert (found.engine_id, found.kv_host, found.kv_port, found.tp_size) == (
        "P-1", "10.0.0.2", 5600, 2)  # fmt: skip
    for bad in ("http://h:8100", "http://h:1=P@h", "http://h:1=@h:5", "http://h:1=P@h:0",
                "http://h:1=P@h:5,tp=0", "http://h:1=P@h:5,pp=2", "http://h:1=P@h:x"):  # fmt: skip
        with pytest.raises(ValueError, match="vllm-side-channel|port|tp"):
            parse_side_channel(bad)


def test_server_info_identity() -> None:
    kv = {"kv_connector": "NixlPushConnector", "engine_id": "P"}
    config = {"kv_transfer_config": kv, "parallel_config": {"tensor_parallel_size": 2}}
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "h", "VLLM_NIXL_SIDE_CHANNEL_PORT": 5}
    raw = {"vllm_config": config, "vllm_env": env}
    found = VLLMIdentity(version="0.32.0").with_server_info(raw)
    assert found.is_addressable and (found.tp_size, found.kv_port) == (2, 5)
    with pytest.raises(ValueError, match="port"):
        raw["vllm_env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "5"
        VLLMIdentity(version="x").with_server_info(raw)
    with pytest.raises(ValueError, match="lacks"):
        VLLMIdentity(version="x").with_server_info({"vllm_config": {}})


def test_vllm_decode_params_are_checked() -> None:
    good = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r",
            "remote_host": "h", "remote_port": 5, "remote_block_ids": [[1]],
            "tp_size": 1}  # fmt: skip
    assert VLLMParams.from_prefill_answer(good).to_sparse_dict() == good
    for name in ("remote_request_id", "remote_port", "remote_block_ids", "do_remote_prefill"):
        bad = {k: v for k, v in good.items() if k != name}
        with pytest.raises(ValueError, match=name):
            VLLMParams.from_prefill_answer(bad)
    with pytest.raises(ValueError, match="remote_port"):
        VLLMParams.from_prefill_answer({**good, "remote_port": True})


def test_a_vllm_router_needs_no_cluster_token() -> None:
    """Our instances take kv_transfer_params only when signed; vLLM's legs are not our signed
    calls, so `--engine vllm` runs without the token that pull and push need otherwise."""
    from disagg.config import RouterConfig

    urls = {"prefill_urls": ("http://h:1",), "decode_urls": ("http://h:2",)}
    assert RouterConfig(mode="push", engine="vllm", **urls).cluster_token == ""
    with pytest.raises(ValueError, match="cluster token"):
        RouterConfig(mode="push", **urls)
    with pytest.raises(ValueError, match="engine"):
        RouterConfig(mode="push", engine="sglang", cluster_token="x" * 32, **urls)  # type: ignore[arg-type]
