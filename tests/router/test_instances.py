"""InstancePool against fake servers: health transitions, cached KV identity, load refresh."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from disagg.config import RouterConfig
from disagg.router.identity import KVInfo
from disagg.router.instances import HEALTH_POLL_INTERVAL_S, InstancePool, normalize_url
from tests.router.fakes import ROUTER_TEST_TOKEN, FakeInstance, run_async, running, wait_until


@asynccontextmanager
async def started_pool(
    p: FakeInstance, d: FakeInstance, health_interval_s: float = HEALTH_POLL_INTERVAL_S, **cfg: Any
) -> AsyncIterator[InstancePool]:
    """An InstancePool over the fakes `p` and `d` (started), under RouterConfig(**cfg)."""
    async with running(p, d) as (p_url, d_url):
        config = RouterConfig(
            prefill_urls=(p_url,), decode_urls=(d_url,), cluster_token=ROUTER_TEST_TOKEN, **cfg
        )
        pool = InstancePool(config, health_interval_s=health_interval_s)
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            try:
                yield pool
            finally:
                await pool.close()


def test_normalize_url() -> None:
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert normalize_url(" http://h:1 ") == "http://h:1"
    assert normalize_url("h") == "http://h"
    for bad in ("http://h:notaport", "ftp://h:1", "http://:1"):
        with pytest.raises(ValueError, match="host:port"):
            normalize_url(bad)


def test_kv_info_from_dict() -> None:
    info = KVInfo.from_dict({"role": "prefill", "engine_id": "e", "kv_host": "h", "kv_port": 5})
    assert info.is_addressable
    assert not KVInfo.from_dict({"role": "both"}).is_addressable
    with pytest.raises(ValueError, match="kv_port"):
        KVInfo.from_dict({"role": "prefill", "kv_port": "5"})
    with pytest.raises(ValueError, match="role"):
        KVInfo.from_dict({"engine_id": "e"})


def test_kv_info_is_refetched_when_an_instance_comes_back() -> None:
    """A restarted P may have a new KV identity: the cache must not outlive an outage."""

    async def main() -> None:
        p, d = FakeInstance("prefill"), FakeInstance("decode")
        async with started_pool(p, d, mode="push", health_interval_s=0.02) as pool:
            prefill = pool.prefill[0]
            assert prefill.is_healthy and prefill.identity is not None
            assert prefill.identity.engine_id.startswith("prefill-")
            p.health_status, p.kv_info = 503, {"engine_id": "restarted"}
            await wait_until(lambda: not prefill.is_healthy)
            assert not pool.is_ready()
            p.health_status = 200
            await wait_until(lambda: prefill.is_healthy)
            assert (await pool.get_identity(prefill)).engine_id == "restarted"
            assert pool.is_ready()

    run_async(main())


def test_least_loaded_pool_polls_load_and_resets_pending() -> None:
    async def main() -> None:
        d = FakeInstance("decode", load={"num_running": 3})
        p = FakeInstance("prefill")
        cfg = {"mode": "pull", "policy": "least_loaded", "load_poll_interval_s": 30.0}
        async with started_pool(p, d, **cfg) as pool:
            decode = pool.decode[0]
            assert decode.load is not None and decode.load.num_running == 3
            assert pool.pick("decode") is decode and decode.num_pending == 1
            d.load = {"num_running": 4}
            await pool.refresh_load(pool.decode)
            assert decode.load.num_running == 4 and decode.num_pending == 0

    run_async(main())
