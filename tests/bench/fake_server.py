"""A tiny fake OpenAI-compatible server (aiohttp) for the benchmark's tests.

Streams `max_tokens` chunks per request, reports usage and our `disagg.breakdown` extra, and
fails requests on demand (HTTP 500, or an error event mid-stream). Used in-process on a thread
(`ThreadedServer`) and by the fake `up` command. Binds only to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["FAKE_BREAKDOWN", "FakeBehavior", "ThreadedServer", "make_app"]

FAKE_BREAKDOWN = {"queue_s": 0.001, "prefill_s": 0.004, "transfer_s": 0.002, "num_bytes": 4096}


@dataclass
class FakeBehavior:
    token_delay_s: float = 0.0  # sleep between streamed chunks
    fail_every: int = 0  # every n-th request (1-based count) gets HTTP 500; 0 = never
    stream_error_every: int = 0  # every n-th request errors after its first chunk; 0 = never
    include_usage: bool = True  # False: the client must count streamed chunks
    tag_answers: bool = False  # each answer's text names its request ("r3-tok0 ..."): unique
    model: str = "fake-model"
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every request body received
    count: int = 0


BEHAVIOR = web.AppKey("behavior", FakeBehavior)


def _num_prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _chunk(body: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
    if "messages" in body:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return {"id": "cmpl-fake", "model": body["model"], "choices": [choice]}


def _final_extras(body: dict[str, Any], n: int) -> dict[str, Any]:
    usage = {"prompt_tokens": _num_prompt_tokens(body), "completion_tokens": n}
    return {"usage": usage, "disagg": {"breakdown": dict(FAKE_BREAKDOWN)}}


async def _stream(request: web.Request, body: dict[str, Any], fail_midway: bool) -> Any:
    b: FakeBehavior = request.app[BEHAVIOR]
    tag = f"r{b.count}-" if b.tag_answers else ""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = int(body["max_tokens"])

    async def send(doc: Any) -> None:
        await resp.write(f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n".encode())

    if "messages" in body:  # chat opens with a role-only delta, which carries no token
        await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for i in range(n):
        await send(_chunk(body, f"{tag}tok{i} ", None))
        if fail_midway:
            await send({"error": {"message": "injected failure", "code": 500}})
            return resp
        await asyncio.sleep(b.token_delay_s)
    await send(_chunk(body, "", "length"))
    if b.include_usage:
        await send({"id": "cmpl-fake", "choices": [], **_final_extras(body, n)})
    await send("[DONE]")
    return resp


async def _generate(request: web.Request) -> web.StreamResponse:
    b: FakeBehavior = request.app[BEHAVIOR]
    body = await request.json()
    b.bodies.append(body)
    b.count += 1
    if b.fail_every and b.count % b.fail_every == 0:
        return web.json_response({"error": {"message": "injected 500"}}, status=500)
    fail_midway = bool(b.stream_error_every and b.count % b.stream_error_every == 0)
    if body.get("stream"):
        return await _stream(request, body, fail_midway)
    n = int(body["max_tokens"])
    doc = {"choices": [{"index": 0, "text": "x " * n, "finish_reason": "length"}]}
    return web.json_response({**doc, **_final_extras(body, n)})


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": request.app[BEHAVIOR].model}]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(behavior: FakeBehavior) -> web.Application:
    app = web.Application()
    app[BEHAVIOR] = behavior
    app.router.add_post("/v1/completions", _generate)
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


class ThreadedServer:
    """Runs `app` (default `make_app(behavior)`) on its own loop thread; `with` starts/stops it."""

    def __init__(self, behavior: FakeBehavior, app: web.Application | None = None) -> None:
        self.behavior = behavior
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner = web.AppRunner(app or make_app(behavior))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
