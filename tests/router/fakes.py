"""Fake prefill/decode instances for router tests: real aiohttp servers on 127.0.0.1 that record
every request and answer through a handler the test can replace. No engine, no torch."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from disagg.config import RouterConfig
from disagg.router.app import make_app, start_server
from disagg.security import auth

__all__ = [
    "PROMPT",
    "FakeInstance",
    "Received",
    "answer_after_abort",
    "completion",
    "default_handler",
    "metric",
    "post",
    "read_events",
    "run_async",
    "running",
    "running_router",
    "sse",
    "sse_response",
    "wait_until",
]

Handler = Callable[["FakeInstance", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]
WAIT_S = 5.0  # every wait in a fake is bounded by this
PROMPT = {"model": "m", "prompt": "hello", "max_tokens": 8}


def run_async(coro: Coroutine[Any, Any, None], timeout_s: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def completion(request_id: str, text: str, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {"id": request_id, "object": "text_completion", "choices": [choice], **extra}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def sse_response(request: web.Request) -> web.StreamResponse:
    """An event-stream answer to `request`, its headers sent."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def answer_after_abort(request_id: str, text: str) -> Handler:
    """A handler that answers `text` only once the router has aborted the request (or after
    WAIT_S): a leg that outlives the other."""

    async def handler(
        fake: FakeInstance, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse:
        await asyncio.wait_for(fake.aborted.wait(), WAIT_S)
        return web.json_response(completion(request_id, text))

    return handler


async def post(url: str, body: Any, path: str = "/v1/completions") -> tuple[int, Any]:
    """A client's POST to the router: (status, JSON answer)."""
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def wait_until(condition: Callable[[], Any], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def metric(url: str, name: str) -> float:
    """One sample of the router's /metrics (0 when absent), e.g. 'x_total{leg="prefill"}'."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    rows = [row for row in text.splitlines() if row.startswith(name + " ")]
    return float(rows[0].split()[-1]) if rows else 0.0


@dataclass(slots=True)
class Received:
    path: str
    headers: dict[str, str]  # lower-cased names
    body: dict[str, Any]
    at_s: float  # time.monotonic() at arrival

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def kv(self) -> dict[str, Any]:
        return self.body.get("kv_transfer_params") or {}


@dataclass
class FakeInstance:
    role: str  # "prefill" | "decode" | "both"
    handler: Handler | None = None  # None = the default answer for the role
    load: dict[str, int] = field(default_factory=dict)
    kv_info: dict[str, Any] = field(default_factory=dict)
    health_status: int = 200
    load_delay_s: float = 0.0  # /load answers this late (a busy instance)
    received: list[Received] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # request ids of POST /kv/release
    fences: list[str] = field(default_factory=list)  # request ids of aborts with "fence"
    holds_fenced: bool = True  # a fenced abort finds the request held (answers fenced false)
    signs_answers: bool = True  # a fenced abort's answer is signed with ROUTER_TEST_TOKEN
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # first generate request
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    probed: asyncio.Event = field(default_factory=asyncio.Event)  # set by every GET /health
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/abort", self._abort)
        app.router.add_post("/kv/release", self._release)
        app.router.add_get("/health", self._health)
        app.router.add_get("/load", self._load)
        app.router.add_get("/kv_info", self._kv_info)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def die_between_probes(self) -> None:
        """Stop right after the router's health probe: until its next probe (0.5 s) the router
        still takes us for healthy, so the next leg it sends us is refused (a crash)."""
        self.probed.clear()
        await asyncio.wait_for(self.probed.wait(), WAIT_S)
        await self.stop()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append(Received(request.path, headers, body, time.monotonic()))
        self.arrived.set()
        handler = self.handler or default_handler
        return await handler(self, request, body)

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborts.append(body["request_id"])
        self.aborted.set()
        if body.get("fence"):
            self.fences.append(body["request_id"])
            return self._signed(request, web.json_response({"fenced": not self.holds_fenced}))
        return web.json_response({})

    def _signed(self, request: web.Request, response: web.Response) -> web.Response:
        """The answer signed as a real instance signs it (over the call's nonce)."""
        header = request.headers.get(auth.SIGNATURE_HEADER)
        if self.signs_answers and header:
            nonce = auth.Signature.parse(header).nonce
            assert isinstance(response.body, bytes)
            signature = auth.sign_answer(ROUTER_TEST_TOKEN, nonce, response.status, response.body)
            response.headers[auth.SIGNATURE_HEADER] = signature
        return response

    async def _release(self, request: web.Request) -> web.Response:
        self.releases.append((await request.json())["request_id"])
        return web.json_response({})

    async def _health(self, _request: web.Request) -> web.Response:
        self.probed.set()
        return web.Response(status=self.health_status)

    async def _load(self, _request: web.Request) -> web.Response:
        await asyncio.sleep(self.load_delay_s)
        base = {"num_running": 0, "num_waiting": 0, "num_free_blocks": 100}
        return web.json_response(
            {**base, "num_total_blocks": 100, "num_queued_prefill_tokens": 0, **self.load}
        )

    async def _kv_info(self, _request: web.Request) -> web.Response:
        port = int(self.url.rsplit(":", 1)[1])
        base = {"engine_id": f"{self.role}-{port}", "role": self.role, "connector": "pull"}
        addr = {"kv_host": "127.0.0.1", "kv_port": port + 1, "block_size": 16, "model": "m"}
        return web.json_response({**base, **addr, **self.kv_info})

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


async def default_handler(
    fake: FakeInstance, request: web.Request, body: dict[str, Any]
) -> web.StreamResponse:
    """P: a one-token answer with pull params and P's breakdown. D: text, streamed if asked."""
    rid = request.headers["X-Request-Id"]
    if fake.role == "prefill":
        params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "p0"}
        params |= {"remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": rid}
        breakdown = {"queue_s": 0.1, "prefill_s": 0.2, "transfer_s": 9.0}
        return web.json_response(
            completion(rid, "A", kv_transfer_params=params, disagg={"breakdown": breakdown})
        )
    final = {"disagg": {"breakdown": {"transfer_s": 0.3, "first_step_s": 0.05}}}
    if not body.get("stream"):
        return web.json_response(completion(rid, "A b c", **final))
    resp = await sse_response(request)
    for text in ("A", " b"):
        await resp.write(sse(completion(rid, text)))
    await resp.write(sse(completion(rid, " c", **final)) + b"data: [DONE]\n\n")
    return resp


async def read_events(resp: aiohttp.ClientResponse, count: int | None = None) -> list[str]:
    """`data:` payloads of an SSE response, stopping after `count` of them (None = to the end)."""
    events: list[str] = []
    while count is None or len(events) < count:
        line = await resp.content.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(line[len(b"data: ") :].decode().strip())
    return events


ROUTER_TEST_TOKEN = "router-tests-cluster-token"


@asynccontextmanager
async def running_router(**cfg: Any) -> AsyncIterator[str]:
    """A router app on a free port; yields its base URL."""
    cfg.setdefault("cluster_token", ROUTER_TEST_TOKEN)
    config = RouterConfig(host="127.0.0.1", port=0, **cfg)
    runner, port = await start_server(make_app(config), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def running(*fakes: FakeInstance) -> AsyncIterator[list[str]]:
    """Start fakes; yields their URLs; stops them all."""
    try:
        yield [await fake.start() for fake in fakes]
    finally:
        for fake in fakes:
            await fake.stop()


@asynccontextmanager
async def routed(prefill: FakeInstance, decode: FakeInstance, mode: str) -> AsyncIterator[str]:
    """One prefill and one decode fake behind a router in `mode`; yields the router's URL."""
    async with running(prefill, decode) as (p_url, d_url):
        async with running_router(prefill_urls=(p_url,), decode_urls=(d_url,), mode=mode) as url:
            yield url
