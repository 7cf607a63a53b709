"""The instance's own endpoints beside the OpenAI API: /v1/models, /health, /load, /kv_info,
/metrics and the internal POST /v1/abort.

Each answers from the `EngineClient` (and the server's metrics) at once; none generates or
blocks the event loop.
"""

from __future__ import annotations

import time

from aiohttp import web

from disagg.protocol import KV_EVENTS_PATH
from disagg.server.engine_client import EngineClient
from disagg.server.json_body import parse_json_body
from disagg.server.metrics import CONTENT_TYPE, ServerMetrics
from disagg.server.openai_api import APIError

__all__ = ["InstanceRoutes"]


class InstanceRoutes:
    """Route handlers that describe and steer the instance, over one engine."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics
        self._created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/abort", self.abort),
            web.get("/health", self.health),
            web.get("/load", self.load),
            web.get("/kv_info", self.kv_info),
            web.get(KV_EVENTS_PATH, self.kv_events),  # internal: /kv/* is signed
            web.get("/metrics", self.metrics),
        ]

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self._engine.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "disagg",
            "max_model_len": self._engine.max_model_len,
            "dtype": self._engine.dtype,  # what the engine computes in
        }
        return web.json_response({"object": "list", "data": [card]})

    async def abort(self, request: web.Request) -> web.Response:
        """Internal: the router aborts a request whose client left. Unknown ids are fine.
        With `"fence": true` an id the engine does not hold is refused from now on, and the
        answer's `fenced` says so: the router may then release the KV it names."""
        body = parse_json_body(await request.read())
        request_id, fence = body.get("request_id"), body.get("fence", False)
        if not isinstance(request_id, str) or not request_id:
            raise APIError(400, "request_id must be a non-empty string", param="request_id")
        if not isinstance(fence, bool):
            raise APIError(400, "fence must be a boolean", param="fence")
        is_fenced = False
        if fence:
            is_fenced = not await self._engine.fence(request_id)
        else:
            await self._engine.abort(request_id)
        return web.json_response({"request_id": request_id, "aborted": True, "fenced": is_fenced})

    async def health(self, request: web.Request) -> web.Response:
        is_healthy = self._engine.is_healthy()
        body = {"status": "ok" if is_healthy else "engine dead"}
        return web.json_response(body, status=200 if is_healthy else 503)

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response(self._engine.load())

    async def kv_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._engine.kv_info())

    async def kv_events(self, request: web.Request) -> web.Response:
        """Internal: what this instance's prefix cache gained and lost since the answer the
        caller last saw (`epoch`, `seq`), or a snapshot when that is gone or unknown."""
        epoch = request.query.get("epoch", "")
        try:
            seq = int(request.query.get("seq", "0"))
        except ValueError:
            raise APIError(400, "seq must be an integer", param="seq") from None
        if seq < 0 or len(epoch) > 64:
            raise APIError(400, "seq must be >= 0 and epoch at most 64 characters", param="seq")
        return web.json_response(self._engine.kv_events(epoch, seq))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})
