"""The router's HTTP app: parse a client request, admit it, hand it to its flow, answer.

Owns the routes, the handlers and the router's lifetime (startup, cleanup). The flows live in
flows.py, pull_flow.py and push_flow.py, the legs in legs.py; admission.py holds the
concurrency limit, metrics.py the counters. Must not rank instances (policy.py) nor poll them
(instances.py), and never buffers a stream: SSE events are relayed as they arrive (relay.py).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)

from disagg.config import HEADER_TIMEOUT_S, RouterConfig
from disagg.router.admission import Admission
from disagg.router.call import make_body_parser, parse_call
from disagg.router.flows import Flows
from disagg.router.instances import InstancePool
from disagg.router.kv_follow import KVFollower
from disagg.router.legs import CONNECT_TIMEOUT_S, Legs
from disagg.router.membership import add_membership_routes
from disagg.router.metrics import RouterMetrics
from disagg.router.middleware import api_key_middleware, error_middleware
from disagg.router.prompt_ids import prompt_token_ids
from disagg.router.relay import CLIENT_GONE, RouteError, error_object
from disagg.security.http_guard import GuardedRunner, body_deadline_middleware
from disagg.server.tokenizer import Tokenizer

__all__ = ["Router", "make_app", "start_server"]

logger = logging.getLogger(__name__)


class Router:
    """The handlers. One per app; its legs' session lives from startup to cleanup."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.pool = InstancePool(cfg)
        self.metrics = RouterMetrics()
        self.admission = Admission(
            cfg.max_concurrent_requests,
            cfg.max_queued_requests,
            cfg.queue_timeout_s,
            on_refused=lambda reason: self.metrics.admission_refused.labels(reason).inc(),
        )
        self.metrics.in_flight.set_function(lambda: self.admission.num_in_flight)
        self.metrics.queued.set_function(lambda: self.admission.num_queued)
        self.legs = Legs(cfg, self.pool, self.metrics)
        self.flows = Flows(cfg, self.legs, self.pool, self.metrics)
        self.body_parser = make_body_parser()
        self.tokenizer = Tokenizer.from_dir(cfg.tokenizer) if cfg.tokenizer else None
        # Keeps the pool's index of the instances' prefix caches (kv_aware, or
        # --kv-index-max-blocks) current.
        index = self.pool.kv_index
        self.kv_follow = None if index is None else KVFollower(cfg, self.pool, index)

    async def startup(self, _app: web.Application) -> None:
        self.legs.start()
        self.body_parser.start()
        await self.pool.start(self.legs.session)
        if self.kv_follow is not None:
            self.kv_follow.start(self.legs.session)

    async def cleanup(self, _app: web.Application) -> None:
        if self.kv_follow is not None:
            await self.kv_follow.close()
        await self.pool.close()
        await self.legs.close()
        self.body_parser.close()

    # ---- handlers -------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "cmpl")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chatcmpl")

    async def _generate(self, request: web.Request, id_prefix: str) -> web.StreamResponse:
        status, request_id = 500, f"{id_prefix}-{uuid.uuid4().hex}"
        try:
            max_prompt_chars = self.cfg.max_prompt_chars or None
            call = await parse_call(request, request_id, max_prompt_chars, self.body_parser)
            if self.cfg.policy == "kv_aware":  # it weighs the prefix each instance holds
                call.prompt_ids = await prompt_token_ids(call.body, call.path, self.tokenizer)
            async with self.admission.slot():  # held until relayed
                relayed = await self.flows.dispatch(call)
            status = relayed.status
            return relayed.response
        except RouteError as exc:
            status = exc.status
            return exc.to_response(request_id)
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        finally:
            self.metrics.requests.labels(self.cfg.mode, str(status)).inc()

    async def models(self, _request: web.Request) -> web.Response:
        for inst in [*self.pool.decode, *self.pool.prefill]:
            if not inst.is_healthy:
                continue
            try:
                timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)
                async with self.legs.session.get(f"{inst.url}/v1/models", timeout=timeout) as resp:
                    if resp.status == 200:
                        return web.Response(body=await resp.read(), content_type="application/json")
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("/v1/models from %s failed: %r", inst.url, exc)
        return RouteError.of(503, "no healthy instance to list models").to_response()

    async def health(self, _request: web.Request) -> web.Response:
        if self.pool.is_ready():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    async def list_instances(self, _request: web.Request) -> web.Response:
        now_s = time.monotonic()
        views = [inst.to_dict(now_s) for inst in self.pool.instances]
        if self.pool.kv_index is not None:  # blocks of each prefix cache the index knows of
            held = self.pool.kv_index.num_held()
            views = [{**view, "kv_index_blocks": held.get(view["url"], 0)} for view in views]
        return web.json_response(views)

    async def metrics_text(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(cfg: RouterConfig, *, client_max_size: int | None = None) -> web.Application:
    """The router as an aiohttp app; serve it with `start_server` (it sets handler cancellation
    so a client disconnect reaches the legs). Bodies over `client_max_size` bytes (default:
    cfg.max_request_bytes) get a 413, bodies not received within cfg.body_timeout_s a 408;
    with cfg.api_key, the OpenAI API needs it as a bearer."""
    router = Router(cfg)
    # The key is checked first: a client without it never gets its body read.
    middlewares = [
        error_middleware,
        api_key_middleware(cfg.api_key),
        body_deadline_middleware(cfg.body_timeout_s),
    ]
    app = web.Application(
        middlewares=middlewares, client_max_size=client_max_size or cfg.max_request_bytes
    )
    app.on_startup.append(router.startup)
    app.on_cleanup.append(router.cleanup)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_text)
    app.router.add_get("/instances", router.list_instances)
    add_membership_routes(app, router.pool, cfg)
    return app


async def start_server(
    app: web.Application,
    host: str,
    port: int,
    *,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0 = any free port); returns the runner (call `cleanup()`) and port.
    A connection that has not sent a request's headers within `header_timeout_s` is closed;
    with `ssl_context` the port speaks HTTPS only."""
    runner = GuardedRunner(
        app, header_timeout_s=header_timeout_s, error_body=error_object, handler_cancellation=True
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except OSError:
        await runner.cleanup()  # stops the poller and closes the session started by setup()
        raise
    bound_port = port or int(runner.addresses[0][1])
    return runner, bound_port
