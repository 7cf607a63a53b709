"""A fake vLLM instance for router tests: a real aiohttp server on 127.0.0.1 that speaks what vLLM
0.32's OpenAI server and NIXL connectors need on the wire, with no engine behind it.

What it holds to vLLM's behaviour (field names and rules from vLLM's `nixl/base_scheduler.py`,
`pull_scheduler.py`, `push_scheduler.py`, `push_worker.py`, `metadata.py`, `utils.py`):
- `GET /version`; no `/kv_info` (404); `GET /server_info?config_format=json` only in dev mode.
- The engine's request id is `cmpl-<X-Request-Id>-0-<8 hex>` (completions); push pairs P's
  finished prefill with D's registration by that id less the random suffix.
- A prefill leg (`do_remote_decode`) answers one token and vLLM's `kv_transfer_params`, and
  keeps its blocks under a lease: pull until D reads them, push until the WRITE to the
  registered decode blocks; past `lease_s` they expire.
- A decode leg (`do_remote_prefill`) indexes `remote_engine_id`, `remote_host`,
  `remote_port`, `remote_request_id`, `remote_block_ids` (and push: `tp_size`): one missing
  kills the engine core, after which the fake refuses every connection, as vLLM's server does.
- A leg whose connection drops is aborted (vLLM cancels a request whose client left).
The fakes of one test share a `Fabric`: the NIXL between them. No torch.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["Fabric", "FakeVLLM", "expected_text"]

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_D_REQUIRED = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id",
               "remote_block_ids")  # fmt: skip


def expected_text(body: dict[str, Any], max_tokens: int) -> list[str]:
    """The tokens any fake answers `body` with: a pure function of the prompt (greedy)."""
    seed = sum(map(ord, json.dumps(body.get("prompt", body.get("messages")))))
    return [f" t{(seed * (i + 7)) % 97}" for i in range(max_tokens)]


@dataclass
class _Finished:
    """P's prefill, done, its blocks leased."""

    engine_request_id: str
    blocks: list[list[int]]
    expires_s: float


@dataclass
class Fabric:
    """The NIXL between fakes: prefill instances by engine id, and the push matching."""

    prefills: dict[str, FakeVLLM] = field(default_factory=dict)
    writes: dict[str, asyncio.Event] = field(default_factory=dict)  # D base id -> written
    registrations: dict[str, str] = field(default_factory=dict)  # base id -> P engine id


@dataclass
class FakeVLLM:
    fabric: Fabric
    connector: str | None = "NixlPushConnector"  # None: an aggregated instance
    engine_id: str = "P"
    dev_mode: bool = True  # serves /server_info
    prefill_s: float = 0.1  # how long a prefill takes
    token_s: float = 0.01  # between streamed tokens
    lease_s: float = 30.0
    prefill_status: int = 200  # a prefill leg's answer status (500: P fails)
    side_port: int = 0  # its NIXL side-channel port (set by start)
    url: str = ""
    received: list[tuple[str, dict[str, str], dict[str, Any], float]] = field(default_factory=list)
    answered_s: dict[str, float] = field(default_factory=dict)  # X-Request-Id -> P answered at
    leases: dict[str, _Finished] = field(default_factory=dict)  # P: base id -> leased blocks
    num_expired: int = 0
    aborted: list[str] = field(default_factory=list)  # X-Request-Ids whose leg was dropped
    other_routes: list[str] = field(default_factory=list)  # anything vLLM does not serve
    is_dead: bool = False  # the engine core died: every connection is refused
    num_running: int = 0  # reported on /metrics beside the requests it is answering
    _open: set[Any] = field(default_factory=set)  # transports of requests being answered
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        port = int(self._runner.addresses[0][1])
        self.url, self.side_port = f"http://127.0.0.1:{port}", port + 1000
        if self.connector is not None:
            self.fabric.prefills[self.engine_id] = self
        return self.url

    async def stop(self) -> None:
        """The process is gone: its port refuses connections, open streams break at once."""
        self.is_dead = True
        for transport in self._open:
            transport.abort()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def expire_leases(self) -> None:
        now_s = time.monotonic()
        for base, finished in list(self.leases.items()):
            if finished.expires_s <= now_s:
                del self.leases[base]
                self.num_expired += 1

    # ---- routes -----------------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def _server_info(self, _request: web.Request) -> web.Response:
        if not self.dev_mode:
            return web.json_response({"detail": "Not Found"}, status=404)
        kv = (
            None
            if self.connector is None
            else {"kv_connector": self.connector, "engine_id": self.engine_id, "kv_role": "kv_both"}
        )
        config = {"kv_transfer_config": kv, "parallel_config": {"tensor_parallel_size": 1}}
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": self.side_port}  # fmt: skip
        return web.json_response({"vllm_config": config, "vllm_env": env, "system_env": {}})

    async def _metrics(self, _request: web.Request) -> web.Response:
        """The gauges least_loaded reads, labelled as vLLM 0.32 labels them."""
        labels = '{engine="0",model_name="m"}'
        running = self.num_running + len(self._open)
        text = (f"vllm:num_requests_running{labels} {float(running)}\n"
                f"vllm:num_requests_waiting{labels} 0.0\n"
                f"vllm:kv_cache_usage_perc{labels} {len(self.leases) / 182}\n"
                'vllm:cache_config_info{block_size="128",num_gpu_blocks="182"} 1.0\n')  # fmt: skip
        return web.Response(text=text, content_type="text/plain")

    async def _other(self, request: web.Request) -> web.Response:
        self.other_routes.append(f"{request.method} {request.path}")
        return web.json_response({"detail": "Not Found"}, status=404)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self._open.add(request.transport)
        try:
            return await self._serve(request)
        finally:
            self._open.discard(request.transport)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append((request.path, headers, body, time.monotonic()))
        rid = headers.get("x-request-id", secrets.token_hex(8))
        engine_rid = f"cmpl-{rid}-0-{secrets.token_hex(4)}"
        params = body.get("kv_transfer_params") or {}
        try:
            if params.get("do_remote_decode"):
                return await self._prefill(engine_rid, rid, body)
            if params.get("do_remote_prefill"):
                return await self._decode(request, engine_rid, params, body)
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise

    async def _prefill(self, engine_rid: str, rid: str, body: dict[str, Any]) -> web.Response:
        await asyncio.sleep(self.prefill_s)  # cancelled here: aborted, nothing leased
        self.answered_s[rid] = time.monotonic()
        if self.prefill_status != 200:
            error = {"message": "prefill failed", "type": "InternalServerError", "code": 500}
            return web.json_response({"error": error}, status=self.prefill_status)
        base = _SUFFIX.sub("", engine_rid)
        blocks = [[1, 2]]
        expires_s = time.monotonic() + self.lease_s
        if self.fabric.registrations.pop(base, None) == self.engine_id:
            self.fabric.writes.setdefault(base, asyncio.Event()).set()  # WRITE now, no lease
        else:
            self.leases[base] = _Finished(engine_rid, blocks, expires_s)
        params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id, "remote_request_id": engine_rid,
            "remote_host": "127.0.0.1", "remote_port": self.side_port, "tp_size": 1,
            "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 5,
            "transfer_mode": "push" if self.connector == "NixlPushConnector" else "pull",
        }  # fmt: skip
        token = expected_text(body, 1)[0]
        return web.json_response(_completion(rid, token, kv_transfer_params=params))

    async def _decode(
        self, request: web.Request, engine_rid: str, params: dict[str, Any], body: dict[str, Any]
    ) -> web.StreamResponse:
        needed = (*_D_REQUIRED, "tp_size") if self.connector == "NixlPushConnector" else _D_REQUIRED
        if any(name not in params for name in needed):
            # KeyError in build_connector_meta: "EngineCore encountered a fatal error".
            asyncio.get_running_loop().create_task(self.stop())
            raise web.HTTPInternalServerError()
        prefill = self.fabric.prefills.get(params["remote_engine_id"])
        assert prefill is not None and params["remote_port"] == prefill.side_port, params
        base = _SUFFIX.sub("", engine_rid)
        if self.connector == "NixlPushConnector":
            await self._await_push(prefill, base)
        else:  # pull: READ P's leased blocks, named by P's own request id
            leased = prefill.leases.pop(_SUFFIX.sub("", params["remote_request_id"]), None)
            assert leased is not None and leased.blocks == params["remote_block_ids"], params
        return await self._answer(request, body)

    async def _await_push(self, prefill: FakeVLLM, base: str) -> None:
        """Register D's blocks with P; wait for P's WRITE (P matches by the base id)."""
        written = self.fabric.writes.setdefault(base, asyncio.Event())
        if prefill.leases.pop(base, None) is not None:
            written.set()  # P had finished: it writes on the registration
        else:
            self.fabric.registrations[base] = prefill.engine_id
        try:
            await asyncio.wait_for(written.wait(), self.lease_s)
        finally:
            self.fabric.registrations.pop(base, None)
            self.fabric.writes.pop(base, None)

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "x")
        tokens = expected_text(body, int(body.get("max_tokens", 16)))
        if not body.get("stream"):
            return web.json_response(_completion(rid, "".join(tokens)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for token in tokens:
            await resp.write(b"data: " + json.dumps(_completion(rid, token)).encode() + b"\n\n")
            await asyncio.sleep(self.token_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _completion(rid: str, text: str, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": None}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice], **extra}
