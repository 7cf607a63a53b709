"""GET /kv/events on a real instance app: internal (signed, its answer signed), bad queries
refused, and the router's follower applying what it answers into its index."""

from __future__ import annotations

import asyncio

import aiohttp
import requests

from disagg.config import RouterConfig
from disagg.protocol import KV_EVENTS_PATH
from disagg.router.instances import InstancePool
from disagg.router.kv_follow import KVFollower
from disagg.router.kv_index import KVIndex
from disagg.security import auth
from tests.router.fakes import running_router
from tests.server.conftest import CLUSTER_TOKEN


def _get(url: str, *, signed: bool) -> requests.Response:
    headers = {}
    if signed:
        headers[auth.SIGNATURE_HEADER] = auth.sign(CLUSTER_TOKEN, "GET", url, b"").header
    return requests.get(url, headers=headers, timeout=10)


def test_kv_events_is_an_internal_route(serve) -> None:  # type: ignore[no-untyped-def]
    engine, server = serve()
    url = f"{server.url}{KV_EVENTS_PATH}?epoch=e1&seq=2"
    assert _get(url, signed=False).status_code == 401  # cached prompts are not for clients
    answer = _get(url, signed=True)
    assert answer.status_code == 200 and auth.SIGNATURE_HEADER in answer.headers
    assert answer.json()["snapshot"] == ["00ff00ff00ff00ff"]
    assert engine.kv_events_asked == [("e1", 2)]
    for query in ("seq=x", "seq=-1", f"epoch={'e' * 65}"):
        assert _get(f"{server.url}{KV_EVENTS_PATH}?{query}", signed=True).status_code == 400


def test_the_router_follows_an_instance_into_its_index(serve) -> None:  # type: ignore[no-untyped-def]
    engine, server = serve()
    cfg = RouterConfig(decode_urls=(server.url,), cluster_token=CLUSTER_TOKEN,
                       kv_index_max_blocks=16)  # fmt: skip
    pool, index = InstancePool(cfg), KVIndex(cfg.kv_index_max_blocks)
    follower = KVFollower(cfg, pool, index)
    (inst,) = pool.instances

    async def follow() -> None:
        async with aiohttp.ClientSession() as session:
            inst.is_healthy = True
            await follower.refresh(session)
            await follower.refresh(session)  # goes on from the answer applied
            inst.is_healthy = False
            await follower.refresh(session)  # unhealthy: it may come back empty

    asyncio.run(follow())
    assert engine.kv_events_asked == [("", 0), ("e1", 3)]
    assert index.followed() == set() and len(index) == 0


def test_a_follower_drops_an_answer_signed_with_another_token(serve) -> None:  # type: ignore[no-untyped-def]
    _, server = serve()
    other = "another-cluster-token-of-enough-length"
    cfg = RouterConfig(decode_urls=(server.url,), cluster_token=other, kv_index_max_blocks=16)
    pool, index = InstancePool(cfg), KVIndex(16)
    (inst,) = pool.instances

    async def follow() -> None:
        async with aiohttp.ClientSession() as session:
            inst.is_healthy = True
            await KVFollower(cfg, pool, index).refresh(session)

    asyncio.run(follow())  # the instance refuses the call (401): nothing is applied
    assert index.followed() == set() and len(index) == 0


def test_a_kv_aware_router_follows_its_instances_by_itself(serve) -> None:  # type: ignore[no-untyped-def]
    """The whole router app (regression: an empty index is falsy, and the follower was never
    built, so kv_aware placed by load alone): its /instances shows the instance's cache."""
    engine, server = serve()

    async def main() -> None:
        router_cfg = {"decode_urls": (server.url,), "policy": "kv_aware",
                      "cluster_token": CLUSTER_TOKEN, "load_poll_interval_s": 0.02}  # fmt: skip
        async with running_router(**router_cfg) as url, aiohttp.ClientSession() as session:
            deadline = asyncio.get_running_loop().time() + 10
            while True:
                async with session.get(f"{url}/instances") as resp:
                    (view,) = await resp.json()
                if view["kv_index_blocks"] == 1:
                    return
                assert asyncio.get_running_loop().time() < deadline, view
                await asyncio.sleep(0.05)

    asyncio.run(main())
    assert engine.kv_events_asked  # the router asked the instance itself
