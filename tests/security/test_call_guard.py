"""Whose call is it: an instance's signature check (server/security.py over security/call_guard)
on real servers on 127.0.0.1. A call is accepted once, by the process it was signed for, under
any of that process's names; its answer is signed for that call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import pytest
import requests
from aiohttp import web

from disagg.security import auth
from disagg.security.call_guard import CallGuard, Identity
from disagg.server.openai_api import APIError
from disagg.server.security import Handler, make_auth_middleware
from tests.server.fakes import ServerThread

TOKEN = "call-guard-tests-cluster-token"
BODY = json.dumps({"request_id": "r-1"}).encode()

Start = Callable[..., ServerThread]


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"echo": json.loads(await request.read())})


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The instance's error shape, as server/app.py writes it."""
    try:
        return await handler(request)
    except APIError as exc:
        return web.json_response(exc.body(), status=exc.status)


def _app(identity: Identity) -> web.Application:
    guard = make_auth_middleware(api_key="", cluster_token=TOKEN, identity=identity)
    app = web.Application(middlewares=[_errors, guard])
    app.router.add_post("/kv/echo", _echo)
    app.router.add_post("/v1/echo", _echo)
    return app


@pytest.fixture
def start() -> Iterator[Start]:
    """start(identity) -> a running instance-like server on 127.0.0.1; stopped at teardown."""
    started: list[ServerThread] = []

    def run(identity: Identity | None = None) -> ServerThread:
        chosen = identity or Identity(hosts=("127.0.0.1",))
        started.append(ServerThread(lambda: _app(chosen)).__enter__())
        return started[-1]

    yield run
    for server in started:
        server.__exit__(None, None, None)


def _send(
    server: ServerThread, signed_for: str, *, path: str = "/kv/echo", request_id: str = ""
) -> tuple[requests.Response, auth.Signature]:
    """POST BODY to `server`, signed as a call to the base URL `signed_for`."""
    signature = auth.sign(TOKEN, "POST", signed_for + path, BODY, request_id=request_id)
    headers = {auth.SIGNATURE_HEADER: signature.header, "Content-Type": "application/json"}
    if request_id:
        headers[auth.REQUEST_ID_HEADER] = request_id
    return requests.post(server.url + path, data=BODY, headers=headers, timeout=10), signature


def _resend(server: ServerThread, first: requests.Response) -> requests.Response:
    """The request behind `first`, byte for byte, to `server` (a replay)."""
    sent = first.request
    return requests.post(server.url + sent.path_url, data=sent.body, headers=sent.headers,
                         timeout=10)  # fmt: skip


def test_a_call_is_accepted_once_and_only_by_its_instance(start: Start) -> None:
    a, b = start(), start()  # two instances on one host: they differ by port
    answer, _ = _send(a, a.url)
    assert answer.status_code == 200
    replayed = _resend(a, answer)
    assert replayed.status_code == 401 and "replayed" in replayed.text
    misdirected = _resend(b, _send(b, a.url)[0])  # signed for A, sent to B twice
    assert misdirected.status_code == 401 and "not this process" in misdirected.text
    first_at_b, _ = _send(b, a.url)
    assert first_at_b.status_code == 401 and f"127.0.0.1:{a.port}" in first_at_b.text


def test_localhost_and_the_loopback_address_name_the_same_instance(start: Start) -> None:
    server = start(Identity())  # no names configured: only the address a call arrives at
    for base in (f"http://localhost:{server.port}", f"http://127.0.0.1:{server.port}"):
        assert _send(server, base)[0].status_code == 200, base
    assert _send(server, f"http://localhost:{server.port + 1}")[0].status_code == 401


def test_advertised_urls_and_hosts_are_this_instances_names(start: Start) -> None:
    """Behind a port mapping the caller's name for us is only known from --advertise-url; a
    --kv-host name holds at the port a call arrives on, and no other."""
    identity = Identity.of(("http://gateway.example:9000",), ("node-7.example", "0.0.0.0"))
    server = start(identity)
    assert identity.hosts == ("node-7.example",)  # a wildcard listen address names nothing
    assert _send(server, "http://gateway.example:9000")[0].status_code == 200
    assert _send(server, "http://gateway.example:9001")[0].status_code == 401
    assert _send(server, f"http://node-7.example:{server.port}")[0].status_code == 200
    assert _send(server, "http://node-7.example:9000")[0].status_code == 401
    assert _send(server, f"http://node-8.example:{server.port}")[0].status_code == 401


def test_a_name_is_resolved_to_the_address_the_call_arrived_at() -> None:
    """A router listing an instance by a DNS name reaches the address that name resolves to."""

    async def main() -> None:
        guard = CallGuard(TOKEN)
        assert "127.0.0.1" in await guard._addresses("localhost")
        assert await guard._addresses("no-such-host.invalid") == frozenset()
        assert await guard._is_mine("localhost:8100", ("127.0.0.1", 8100))
        assert not await guard._is_mine("localhost:8100", ("10.0.0.3", 8100))
        assert not await guard._is_mine("no-such-host.invalid:8100", ("127.0.0.1", 8100))

    asyncio.run(main())


def test_a_loopback_name_is_this_instances_only_over_loopback() -> None:
    """Every host has a 127.0.0.1: a call a peer made to its own loopback, replayed to us
    over the network, is not ours even if our --kv-host is left at 127.0.0.1."""

    async def main() -> None:
        guard = CallGuard(TOKEN, Identity(hosts=("127.0.0.1", "127.0.0.2")))
        assert await guard._is_mine("127.0.0.2:8100", ("127.0.0.1", 8100))  # a tap, on lo
        for authority in ("127.0.0.1:8100", "localhost:8100", "[::1]:8100"):
            assert not await guard._is_mine(authority, ("10.0.0.3", 8100)), authority

    asyncio.run(main())


def test_the_answer_is_signed_for_its_call(start: Start) -> None:
    server = start()
    answer, signature = _send(server, server.url)
    header = answer.headers[auth.SIGNATURE_HEADER]
    auth.check_answer(TOKEN, header, signature.nonce, answer.status_code, answer.content)
    with pytest.raises(auth.SignatureError, match="not for this call"):
        auth.check_answer(TOKEN, header, _send(server, server.url)[1].nonce, 200, answer.content)


def test_a_bad_signature_on_a_public_route_is_refused_not_ignored(start: Start) -> None:
    """A replayed leg must not pass as an unsigned request, nor an altered X-Request-Id."""
    server = start()
    leg, _ = _send(server, server.url, path="/v1/echo", request_id="leg-1")
    assert leg.status_code == 200
    replayed = _resend(server, leg)
    assert replayed.status_code == 401 and "replayed" in replayed.text
    altered = leg.request.copy()
    altered.headers[auth.REQUEST_ID_HEADER] = "leg-2"
    answer = requests.Session().send(altered, timeout=10)
    assert answer.status_code == 401 and "bad cluster signature" in answer.text
    assert requests.post(server.url + "/v1/echo", data=BODY, timeout=10).status_code == 200
