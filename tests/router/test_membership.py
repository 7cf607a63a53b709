"""Live membership: registration and heartbeats through the router's signed routes (against fake
instances), and the pool's bookkeeping (roles, draining, expiry) on its own."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from disagg.config import RouterConfig
from disagg.router.instances import InstancePool, MembershipError
from disagg.security import auth
from tests.router.fakes import ROUTER_TEST_TOKEN, FakeInstance, run_async, running, running_router


async def post(url: str, path: str, body: Any, *, token: str | None = ROUTER_TEST_TOKEN) -> int:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[auth.SIGNATURE_HEADER] = auth.sign(token, "POST", url + path, data).header
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=data, headers=headers) as resp:
            return resp.status


async def instances(url: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url + "/instances") as resp:
        return {row["url"]: row for row in await resp.json()}


def test_a_registered_instance_serves_and_a_draining_one_gets_no_new_work() -> None:
    async def main() -> None:
        a, b = FakeInstance("both"), FakeInstance("both")
        async with running(a, b) as (a_url, b_url), running_router(mode="aggregated") as url:
            for inst_url in (a_url, b_url):
                assert (
                    await post(url, "/internal/register", {"url": inst_url, "role": "both"}) == 200
                )
            deadline = time.monotonic() + 5
            while not all(r["healthy"] for r in (await instances(url)).values()):
                assert time.monotonic() < deadline, await instances(url)
                await asyncio.sleep(0.05)
            body = {"url": b_url, "role": "both", "draining": True}
            assert await post(url, "/internal/register", body) == 200
            async with aiohttp.ClientSession() as session:
                for _ in range(4):
                    async with session.post(url + "/v1/completions", json={"prompt": [5, 6]}) as r:
                        assert r.status == 200
            assert len(a.received) == 4 and b.received == []
            rows = await instances(url)
            assert rows[b_url]["draining"] and rows[b_url]["source"] == "registered"
            assert await post(url, "/internal/deregister", {"url": b_url}) == 200
            assert b_url not in await instances(url)

    run_async(main())


@pytest.mark.parametrize(
    ("token", "body", "status"),
    [
        (None, {"url": "http://127.0.0.1:1", "role": "both"}, 401),  # unsigned
        ("another-token-of-enough-length-000", {"url": "http://127.0.0.1:1", "role": "both"}, 401),
        (ROUTER_TEST_TOKEN, {"url": "http://127.0.0.1:1", "role": "prefill"}, 409),  # wrong role
        (ROUTER_TEST_TOKEN, {"url": "not a url", "role": "both"}, 400),
        (ROUTER_TEST_TOKEN, {"url": "ftp://h:1", "role": "both"}, 400),
        (ROUTER_TEST_TOKEN, ["not", "an", "object"], 400),
        (ROUTER_TEST_TOKEN, {"role": "both"}, 400),
    ],
)
def test_registrations_are_signed_and_checked(token: str | None, body: Any, status: int) -> None:
    async def main() -> None:
        async with running_router(mode="aggregated") as url:
            assert await post(url, "/internal/register", body, token=token) == status
            assert await instances(url) == {}

    run_async(main())


def pool(mode: str = "push", **cfg: Any) -> InstancePool:
    return InstancePool(RouterConfig(mode=mode, cluster_token="t" * 32, **cfg))  # type: ignore[arg-type]


def test_pool_puts_each_role_in_its_pool_and_refuses_a_role_change() -> None:
    p = pool()
    p.register("http://h:1", "prefill")
    p.register("h:2", "decode")
    assert [i.url for i in p.prefill] == ["http://h:1"] and [i.url for i in p.decode] == [
        "http://h:2"
    ]
    with pytest.raises(MembershipError, match="already a prefill"):
        p.register("http://h:1", "decode")
    with pytest.raises(MembershipError, match="not 'both'"):
        p.register("http://h:3", "both")


def test_only_registered_instances_expire_and_a_heartbeat_renews() -> None:
    p = pool(decode_urls=("http://static:1",), prefill_urls=("http://static:2",))
    p.register("http://h:1", "decode")
    stale = p.register("http://h:2", "decode")
    stale.last_heartbeat_s = time.monotonic() - 10
    gone = p.expire(time.monotonic())
    assert [i.url for i in gone] == ["http://h:2"]
    assert {i.url for i in p.instances} == {"http://static:1", "http://static:2", "http://h:1"}
    p.register("http://h:2", "decode")  # a restarted instance comes back
    assert p.find("http://h:2") is not None and not p.expire(time.monotonic())


def test_a_draining_instance_is_never_chosen() -> None:
    p = pool(mode="aggregated")
    first = p.register("http://h:1", "both")
    second = p.register("http://h:2", "both", is_draining=True)
    first.is_healthy = second.is_healthy = True
    assert {p.pick("decode").url for _ in range(4)} == {"http://h:1"}
    assert p.is_ready()
    first.is_draining = True
    assert not p.is_ready()
