"""Router endpoints other than the flows: /health, /instances, /v1/models, /metrics, bad input."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.helpers import free_port
from tests.router.fakes import (
    FakeInstance,
    routed,
    run_async,
    running,
    running_router,
)


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


def test_health_and_instances_reflect_each_role() -> None:
    async def main() -> None:
        dead_prefill = f"http://127.0.0.1:{free_port()}"
        d = FakeInstance("decode")
        async with running(d) as (d_url,):
            cfg: dict[str, Any] = {"prefill_urls": (dead_prefill + "/",), "decode_urls": (d_url,)}
            async with running_router(mode="pull", **cfg) as url:
                status, _ = await get(url + "/health")
                assert status == 503  # no healthy prefill instance
                async with aiohttp.ClientSession() as session:
                    async with session.get(url + "/instances") as resp:
                        rows = await resp.json()
                    async with session.post(url + "/v1/completions", json={"prompt": "x"}) as resp:
                        assert resp.status == 503
                        error = (await resp.json())["error"]
        keys = ("url", "role", "healthy", "draining", "source")
        assert [{k: row[k] for k in keys} for row in rows] == [
            {"url": dead_prefill, "role": "prefill", "healthy": False, "draining": False,
             "source": "static"},
            {"url": d_url, "role": "decode", "healthy": True, "draining": False,
             "source": "static"},
        ]  # fmt: skip
        assert set(error) == {"message", "type", "param", "code"} and "prefill" in error["message"]
        assert d.received == []

    run_async(main())


def test_health_ok_when_every_needed_role_is_healthy() -> None:
    async def main() -> None:
        p, d = FakeInstance("prefill"), FakeInstance("decode")
        async with routed(p, d, mode="push") as url:
            assert (await get(url + "/health"))[0] == 200

    run_async(main())


def test_bad_json_is_400_in_openai_shape() -> None:
    async def main() -> None:
        d = FakeInstance("both")
        async with running(d) as (d_url,), running_router(decode_urls=(d_url,)) as url:
            async with aiohttp.ClientSession() as session:
                for raw in (b"{not json", b"[1, 2]", b'{"stream": "yes"}'):
                    async with session.post(url + "/v1/chat/completions", data=raw) as resp:
                        assert resp.status == 400, raw
                        error = (await resp.json())["error"]
                        assert error["code"] in ("invalid_json", "invalid_value"), error
                        assert error["type"] == "invalid_request_error"
                        assert error["message"]
        assert d.received == []

    run_async(main())


def test_models_come_from_a_healthy_instance() -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        d = FakeInstance("both")
        async with running(d) as (d_url,), running_router(decode_urls=(dead, d_url)) as url:
            status, text = await get(url + "/v1/models")
        assert status == 200 and '"id": "m"' in text

    run_async(main())


def test_round_robin_spreads_requests_and_skips_unhealthy() -> None:
    async def main() -> None:
        a, b, down = FakeInstance("both"), FakeInstance("both"), FakeInstance("both")
        down.health_status = 503
        async with running(a, b, down) as urls, running_router(decode_urls=tuple(urls)) as url:
            async with aiohttp.ClientSession() as session:
                for _ in range(4):
                    body = {"prompt": "x", "max_tokens": 2}
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
        assert (len(a.received), len(b.received), len(down.received)) == (2, 2, 0)

    run_async(main())


def test_metrics_count_requests_by_mode_and_status_and_time_legs() -> None:
    async def main() -> None:
        p, d = FakeInstance("prefill"), FakeInstance("decode")
        async with routed(p, d, mode="pull") as url:
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/completions", json={"prompt": "x"}):
                    pass
                async with session.post(url + "/v1/completions", data=b"{"):
                    pass
            _, text = await get(url + "/metrics")
        assert 'disagg_router_requests_total{mode="pull",status="200"} 1.0' in text
        assert 'disagg_router_requests_total{mode="pull",status="400"} 1.0' in text
        assert 'disagg_router_leg_seconds_count{leg="prefill"} 1.0' in text
        assert 'disagg_router_leg_seconds_count{leg="decode"} 1.0' in text

    run_async(main())
