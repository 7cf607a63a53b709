"""Replays of recorded internal calls, end to end: an attacker who can read internal HTTP (here a
wiretap relaying the router's and the instances' calls) sends a signed call again, byte for
byte, to the instance it was meant for or to another one. Each must be refused (401) and
change nothing.

The prefill instance advertises its KV side channel at 127.0.0.2 (`--kv-host`), where a tap
relays to it, so the router's legs and the decode instance's handshake pass the tap; the
decode instance is reached through a tap it names with `--advertise-url`. Membership replays
run against an in-process router that records what reaches it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from disagg.config import RouterConfig
from disagg.router.app import make_app, start_server
from disagg.server.registration import Registration
from tests.e2e.client import complete, completion_body, prompt_ids
from tests.e2e.cluster import Proc, assert_pools_full, running_cluster
from tests.router.fakes import ROUTER_TEST_TOKEN, FakeInstance, run_async
from tests.security.wiretap import Recorded, Wiretap, send_raw

HOST = "127.0.0.1"
TAP_HOST = "127.0.0.2"  # all of 127/8 is loopback: a tap here can take the prefill's port
NUM_REPLAYS = 40  # the attack sent 1000 in 0.9 s; 40 at once hold as many leases


@dataclass(frozen=True, slots=True)
class Tapped:
    prefill: Proc  # reached by the router and by `decode` only through prefill_tap
    other_prefill: Proc  # a second prefill instance nobody sends anything to
    decode: Proc  # reached by the router only through decode_tap
    router: Proc  # pull
    prefill_tap: Wiretap
    decode_tap: Wiretap


@pytest.fixture(scope="module")
def tapped(request: pytest.FixtureRequest, tiny_qwen3_dir: Path) -> Iterator[Tapped]:
    decode_tap = Wiretap((HOST, 0))
    taps = [decode_tap]
    try:
        with running_cluster(request, "replay", tiny_qwen3_dir) as cluster:
            prefill = cluster.serve("p", role="prefill", transport="tcp",
                                    args=["--kv-host", TAP_HOST])  # fmt: skip
            other = cluster.serve("p-other", role="prefill", transport="tcp")
            decode = cluster.serve("d", role="decode", transport="tcp",
                                   args=["--advertise-url", decode_tap.url])  # fmt: skip
            cluster.wait_ready()
            decode_tap.upstream = _address(decode)
            prefill_tap = Wiretap((TAP_HOST, _address(prefill)[1]), _address(prefill))
            taps.append(prefill_tap)
            router = cluster.route("router", [prefill_tap], [decode_tap], mode="pull")  # type: ignore[list-item]
            yield Tapped(prefill, other, decode, router, prefill_tap, decode_tap)
    finally:
        for tap in taps:
            tap.close()


def test_a_replayed_decode_leg_is_refused(tapped: Tapped) -> None:
    """Attack: the pull decode leg (router -> D, its body names P's blocks) sent again after
    P freed those blocks and another request took them: D read them and answered with the
    other client's continuation. Now D refuses the second copy of the call."""
    victim = completion_body(prompt_ids(1, 48), 8)
    assert complete(tapped.router.url, victim).status == 200
    leg = _last_with_kv_params(tapped.decode_tap.requests("/v1/completions"))
    other = completion_body(prompt_ids(2, 48), 8)  # P's freed blocks now hold this one's KV
    assert complete(tapped.router.url, other).status == 200
    status, body = send_raw(_address(tapped.decode), leg.raw)
    assert status == 401 and b"replayed" in body, (status, body[:300])
    assert_pools_full(tapped.prefill, tapped.decode)


def test_a_kv_handshake_replayed_to_another_prefill_instance_is_refused(tapped: Tapped) -> None:
    """Attack: D's signed /kv/handshake with P, sent to a different prefill instance: it
    answered with its own transport metadata (what NIXL needs to read and write its KV).
    Now the call is refused there (signed for another destination), and by P (replayed)."""
    assert complete(tapped.router.url, completion_body(prompt_ids(3, 20), 2)).status == 200
    (handshake,) = tapped.prefill_tap.requests("/kv/handshake")  # once per peer
    status, body = send_raw(_address(tapped.other_prefill), handshake.raw)
    assert status == 401 and b"metadata" not in body, (status, body[:300])
    assert b"not this" in body, body[:300]
    status, body = send_raw(_address(tapped.prefill), handshake.raw)
    assert status == 401 and b"replayed" in body, (status, body[:300])


def test_a_replayed_prefill_leg_holds_no_blocks(tapped: Tapped) -> None:
    """Attack: one prefill leg (router -> P) sent again and again: each copy that got in was a
    new prefill whose KV P held for a pull that never came (its lease), and a stream of them
    kept the pool drained. Now every copy is refused and the pool stays full."""
    assert complete(tapped.router.url, completion_body(prompt_ids(4, 64), 2)).status == 200
    leg = _last_with_kv_params(tapped.prefill_tap.requests("/v1/completions"))
    assert_pools_full(tapped.prefill)  # D read the KV; P freed it and the request id
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: send_raw(_address(tapped.prefill), leg.raw),
                                range(NUM_REPLAYS)))  # fmt: skip
    assert [status for status, _ in answers] == [401] * NUM_REPLAYS, answers[:2]
    assert_pools_full(tapped.prefill)


def test_a_replayed_deregister_or_draining_register_is_refused() -> None:
    """Attack: an instance's signed deregister, or its "draining" registration, sent again
    every 0.2 s after it came back: the router dropped it (or sent it nothing) and clients
    got 503. Now both copies are refused and the instance keeps serving."""

    async def main() -> None:
        recorded: list[Recorded] = []
        fake = FakeInstance("both")
        async with _recording_router(recorded) as url:
            inst_url = await fake.start()
            try:
                await _register_drain_and_leave(url, inst_url)
                back = Registration(url, inst_url, "both", ROUTER_TEST_TOKEN, heartbeat_s=30)
                await back.start()  # it restarted: one registration, no heartbeat before 30 s
                await _until_listed(url, inst_url)
                draining = [r for r in recorded if b'"draining": true' in r.body]
                deregister = [r for r in recorded if r.path == "/internal/deregister"]
                for old in (draining[-1], deregister[-1]):
                    status, text = await _resend(url, old)
                    assert status == 401 and "replayed" in text, (old.path, status, text)
                    row = (await _instances(url)).get(inst_url)
                    assert row is not None and not row["draining"], row
                await back.leave()
            finally:
                await fake.stop()

    run_async(main())


# ---- helpers ---------------------------------------------------------------------------------


def _address(proc: Proc) -> tuple[str, int]:
    host, port = proc.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _last_with_kv_params(requests: list[Recorded]) -> Recorded:
    legs = [r for r in requests if "kv_transfer_params" in json.loads(r.body)]
    assert legs, f"no leg with kv_transfer_params among {len(requests)} recorded"
    return legs[-1]


class _recording_router:
    """An in-process router (aggregated, no instance named) whose membership calls are kept
    as they arrived, before any check."""

    def __init__(self, recorded: list[Recorded]) -> None:
        self.recorded = recorded
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> str:
        @web.middleware
        async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
            if request.path.startswith("/internal/"):
                headers = {k.lower(): v for k, v in request.headers.items()}
                raw = b"\r\n\r\n" + await request.read()
                self.recorded.append(Recorded(request.method, request.path, headers, raw))
            return await handler(request)

        cfg = RouterConfig(host=HOST, port=0, mode="aggregated", cluster_token=ROUTER_TEST_TOKEN)
        app = make_app(cfg)
        app.middlewares.insert(0, record)
        self.runner, port = await start_server(app, HOST, 0)
        return f"http://{HOST}:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def _register_drain_and_leave(url: str, inst_url: str) -> None:
    """One instance's whole membership, as `disagg serve --router` runs it."""
    registration = Registration(url, inst_url, "both", ROUTER_TEST_TOKEN, heartbeat_s=0.05)
    await registration.start()
    await _until_listed(url, inst_url)
    assert await registration.drain(lambda: True, timeout_s=1.0)
    await registration.leave()
    assert inst_url not in await _instances(url)


async def _until_listed(url: str, inst_url: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (row := (await _instances(url)).get(inst_url)) is None or row["draining"]:
        assert time.monotonic() < deadline, f"{inst_url} never listed as serving: {row}"
        await asyncio.sleep(0.02)


async def _instances(url: str) -> dict[str, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(url + "/instances") as resp:
        return {row["url"]: row for row in await resp.json()}


async def _resend(url: str, old: Recorded) -> tuple[int, str]:
    """The recorded call again: the same body and the same signed headers."""
    kept = ("content-type", "x-disagg-signature", "x-request-id")
    headers = {k: v for k, v in old.headers.items() if k in kept}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + old.path, data=old.body, headers=headers) as resp:
            return resp.status, await resp.text()
