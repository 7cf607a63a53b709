"""The router's HTTP app: parse a client request, ask the policy, proxy the legs, stream back.

Owns the three request flows (aggregated, pull, push) and aborting the other leg when one fails;
call.py shapes the legs' bodies, metrics.py holds the counters. Must not rank instances
(policy.py) nor poll them (instances.py), and never buffers a stream: SSE events are relayed as
they arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)

from disagg import auth
from disagg.config import RouterConfig
from disagg.router.call import Call, kv_params, parse_call, prefill_body, push_params
from disagg.router.instances import LATE_BINDING_TIMEOUT_S, Instance, InstancePool, KVInfo
from disagg.router.membership import add_membership_routes
from disagg.router.metrics import RouterMetrics
from disagg.router.middleware import api_key_middleware, error_middleware
from disagg.router.policy import NoHealthyInstanceError
from disagg.router.relay import (
    CLIENT_GONE,
    BreakdownSource,
    Leg,
    Relayed,
    RouteError,
    breakdown_of,
    read_all,
    relay,
)

__all__ = ["Router", "make_app", "start_server"]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
ABORT_TIMEOUT_S = 2.0
PREFILL_ANSWER_GRACE_S = 2.0  # push: D is done; how long its final chunk waits for P's breakdown


class Router:
    """The flows. One per app; `session` lives from startup to cleanup."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.pool = InstancePool(cfg)
        self.metrics = RouterMetrics()
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "router used before startup"
        return self._session

    async def startup(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=self.cfg.request_timeout_s, sock_connect=CONNECT_TIMEOUT_S
        )
        connector = aiohttp.TCPConnector(limit=0)  # the instances, not the router, set concurrency
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        await self.pool.start(self._session)

    async def cleanup(self, _app: web.Application) -> None:
        await self.pool.close()
        if self._background:  # aborts in flight: let them land, bounded
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        for task in list(self._background):
            task.cancel()
        await self.session.close()

    # ---- handlers -------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "cmpl")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chatcmpl")

    async def _generate(self, request: web.Request, id_prefix: str) -> web.StreamResponse:
        status, request_id = 500, f"{id_prefix}-{uuid.uuid4().hex}"
        try:
            call = await parse_call(request, request_id)
            relayed = await self._dispatch(call)
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

    async def _dispatch(self, call: Call) -> Relayed:
        try:
            try:
                if self.cfg.mode == "pull":
                    return await self._pull(call)
                if self.cfg.mode == "push":
                    return await self._push(call)
                return await self._aggregated(call)
            except RouteError as exc:
                if not self._should_recompute(exc):
                    raise
                return await self._recompute_on_decode(call, exc)
        except NoHealthyInstanceError as exc:
            raise RouteError.of(503, str(exc)) from exc

    def _should_recompute(self, exc: RouteError) -> bool:
        """Policy `recompute`: a prefill instance that died or hung (5xx, nothing streamed yet)
        costs the client its disaggregation, not its answer. A 4xx is the request's fault."""
        return (
            self.cfg.failure_policy == "recompute"
            and self.cfg.mode != "aggregated"
            and exc.leg == "prefill"
            and exc.status >= 500
        )

    async def _recompute_on_decode(self, call: Call, cause: RouteError) -> Relayed:
        """The whole request to a decode instance, which prefills it itself. A fresh id: the
        abandoned legs' ids may still be held while their aborts land."""
        logger.warning("request %s: prefill leg failed (%s); prefilling on a decode instance",
                       call.request_id, cause)  # fmt: skip
        self.metrics.recomputed.inc()
        retry = call.retry(f"{call.request_id}-local")
        inst = self.pool.pick("decode")
        started_s = time.monotonic()
        resp = await self._post(inst, retry, retry.body, "decode")
        return await self._respond(retry, resp, "decode", started_s, None)

    async def models(self, _request: web.Request) -> web.Response:
        for inst in [*self.pool.decode, *self.pool.prefill]:
            if not inst.is_healthy:
                continue
            try:
                timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)
                async with self.session.get(f"{inst.url}/v1/models", timeout=timeout) as resp:
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
        return web.json_response([inst.to_dict(now_s) for inst in self.pool.instances])

    async def metrics_text(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- flows ----------------------------------------------------------------------------

    async def _aggregated(self, call: Call) -> Relayed:
        inst = self.pool.pick("decode")
        started_s = time.monotonic()
        resp = await self._post(inst, call, call.body, "aggregated")
        return await self._respond(call, resp, "aggregated", started_s, None)

    async def _pull(self, call: Call) -> Relayed:
        """P first; D is chosen only once P is done, from load read now (late binding)."""
        if not self.pool.has_healthy("decode"):
            # Prefilling now would hold P's blocks for a handoff nobody can take.
            raise NoHealthyInstanceError("no healthy decode instance")
        prefill = self.pool.pick("prefill")
        params = kv_params(do_remote_decode=True, connector="pull")
        answer = await self._prefill(prefill, call, params)
        d_params = answer.get("kv_transfer_params")
        if not isinstance(d_params, dict) or not d_params:
            # Without them D would silently prefill again: fail loudly instead.
            raise RouteError.of(502, "prefill answer has no kv_transfer_params", leg="prefill")
        if self.pool.uses_load:
            await self.pool.refresh_load(self.pool.decode, LATE_BINDING_TIMEOUT_S)
        decode = self.pool.pick("decode")
        p_breakdown = breakdown_of(answer)
        relayed: Relayed | None = None
        is_unread = False  # True once D surely never started a READ of P's blocks
        try:
            started_s = time.monotonic()
            body = call.body_with({**d_params, "connector": "pull"})
            resp = await self._post(decode, call, body)
            relayed = await self._respond(call, resp, "decode", started_s, _constant(p_breakdown))
            return relayed
        except RouteError as exc:
            # D never got it, or answered 4xx: only for a request its engine never took.
            is_unread = exc.unsent or (exc.leg == "decode" and 400 <= exc.status < 500)
            raise
        finally:
            if relayed is None or relayed.status >= 400:
                self._abort(prefill, call.request_id)  # free P's held blocks before the lease does
                if is_unread:  # P keeps a lease past an abort (reads are one-sided) unless told
                    self._release(prefill, str(d_params.get("remote_request_id")))

    async def _push(self, call: Call) -> Relayed:
        """Both legs at once, keyed by a fresh transfer id; D's stream is relayed as it comes."""
        prefill, decode = self.pool.pick("prefill"), self.pool.pick("decode")
        info = await self._kv_identity(prefill, "prefill")
        d_info = await self._kv_identity(decode, "decode")
        assert info.engine_id and info.kv_host and info.kv_port is not None  # is_addressable
        p_params, d_params = push_params(
            uuid.uuid4().hex, info.engine_id, info.kv_host, info.kv_port, d_info.engine_id
        )
        started_s = time.monotonic()
        p_task = asyncio.create_task(self._prefill(prefill, call, p_params))
        d_task = asyncio.create_task(self._post(decode, call, call.body_with(d_params)))
        relayed: Relayed | None = None
        error: RouteError | None = None
        try:
            d_resp = await _first_response(d_task, p_task)
            relayed = await self._relay_push(call, d_resp, p_task, started_s)
            error = relayed.error
            return relayed
        except RouteError as exc:
            error = exc
            raise
        finally:
            is_ok = relayed is not None and relayed.status < 400
            self._end_push(call, prefill, decode, p_task, d_task, None if is_ok else error, is_ok)

    async def _relay_push(
        self,
        call: Call,
        d_resp: aiohttp.ClientResponse,
        p_task: asyncio.Task[dict[str, Any]],
        started_s: float,
    ) -> Relayed:
        def fail_decode_read(task: asyncio.Task[dict[str, Any]]) -> None:
            # P failed while D's answer is being read: wake the reader with P's error.
            if not task.cancelled() and isinstance(task.exception(), RouteError):
                d_resp.content.set_exception(task.exception())  # type: ignore[arg-type]

        async def prefill_breakdown() -> dict[str, Any] | None:
            await asyncio.wait({p_task}, timeout=PREFILL_ANSWER_GRACE_S)
            if p_task.done() and not p_task.cancelled() and p_task.exception() is None:
                return breakdown_of(p_task.result())
            return None

        p_task.add_done_callback(fail_decode_read)
        try:
            return await self._respond(call, d_resp, "decode", started_s, prefill_breakdown)
        finally:
            p_task.remove_done_callback(fail_decode_read)

    def _end_push(
        self,
        call: Call,
        prefill: Instance,
        decode: Instance,
        p_task: asyncio.Task[dict[str, Any]],
        d_task: asyncio.Task[aiohttp.ClientResponse],
        error: RouteError | None,
        is_ok: bool,
    ) -> None:
        """Make sure neither leg outlives the request: abort the one that did not fail."""
        if error is not None and error.leg == "prefill":
            d_task.cancel()
            self._abort(decode, call.request_id)
        elif not is_ok:  # D failed, the client left, or the handler was cancelled
            p_task.cancel()
            d_task.cancel()  # before D's headers: dropping the connection aborts it on D
            self._abort(prefill, call.request_id)
        if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
            d_task.result().close()  # no-op once relayed; else frees a response nobody reads
        elif not d_task.done():
            self._keep(d_task)  # being cancelled: let it finish with the other background work
        if p_task.done():
            _consume(p_task)
        else:  # D is done and P's answer is still on its way, or P is being cancelled
            self._keep(p_task)

    # ---- legs -----------------------------------------------------------------------------

    async def _kv_identity(self, inst: Instance, leg: Leg) -> KVInfo:
        try:
            info = await self.pool.get_kv_info(inst)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise RouteError.of(502, f"no kv_info from {inst.url}: {exc!r}", leg=leg) from exc
        if not info.is_addressable:
            raise RouteError.of(502, f"{inst.url} has no KV address for push", leg=leg)
        return info

    async def _prefill(self, inst: Instance, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        """The P leg, to its JSON answer. Raises RouteError(leg="prefill") on any failure."""
        started_s = time.monotonic()
        resp = await self._post(inst, call, prefill_body(call.body, params), "prefill")
        try:
            body = await read_all(resp, "prefill")
        finally:
            resp.release()
        self.metrics.leg_seconds.labels("prefill").observe(time.monotonic() - started_s)
        if resp.status >= 400:
            raise RouteError.from_upstream(resp.status, body, resp.content_type, "prefill")
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise RouteError.of(502, f"prefill instance {inst.url} sent no JSON", leg="prefill")
        return answer

    async def _post(
        self, inst: Instance, call: Call, body: dict[str, Any], leg: Leg = "decode"
    ) -> aiohttp.ClientResponse:
        """Send one leg; returns once the instance's headers arrive."""
        url = f"{inst.url}{call.path}"
        data = json.dumps(body).encode()
        headers = {**call.upstream_headers, **self._signature(call.path, data)}
        try:
            return await self.session.post(url, data=data, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            self.pool.mark_unhealthy(inst, repr(exc))
            error = RouteError.of(502, f"cannot reach {leg} instance {inst.url}", leg=leg)
            error.unsent = True  # the instance never saw it
            raise error from exc
        except aiohttp.ClientError as exc:
            raise RouteError.of(502, f"{leg} instance {inst.url}: {exc!r}", leg=leg) from exc
        except TimeoutError as exc:
            raise RouteError.of(504, f"{leg} instance {inst.url} timed out", leg=leg) from exc

    def _abort(self, inst: Instance, request_id: str) -> None:
        """POST /v1/abort in the background: it must land even if this handler is cancelled."""
        self._keep(asyncio.create_task(self._post_internal(inst, "/v1/abort", request_id)))

    def _release(self, inst: Instance, request_id: str) -> None:
        """Pull: tell P that no decode instance read its lease, so the blocks go now."""
        self._keep(asyncio.create_task(self._post_internal(inst, "/kv/release", request_id)))

    async def _post_internal(self, inst: Instance, path: str, request_id: str) -> None:
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
        data = json.dumps({"request_id": request_id}).encode()
        headers = self._signature(path, data)
        try:
            async with self.session.post(
                f"{inst.url}{path}", data=data, headers=headers, timeout=timeout
            ) as resp:
                logger.info("%s %s on %s: %s", path, request_id, inst.url, resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("%s %s on %s failed: %r", path, request_id, inst.url, exc)

    def _signature(self, path: str, data: bytes) -> dict[str, str]:
        """Headers that make a leg a cluster call: instances accept kv_transfer_params and
        aborts only when signed with the cluster token."""
        return auth.json_headers(self.cfg.cluster_token, path, data)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_consume)

    async def _respond(
        self,
        call: Call,
        resp: aiohttp.ClientResponse,
        leg: Leg,
        sent_s: float,
        prefill_breakdown: BreakdownSource | None,
    ) -> Relayed:
        """Relay the leg that answers the client; the leg is timed from `sent_s` to its end."""

        def on_first_byte() -> None:
            elapsed_s = time.monotonic() - call.started_s
            self.metrics.first_byte_seconds.labels(self.cfg.mode).observe(elapsed_s)

        try:
            return await relay(
                call.request, resp, leg, call.request_id, prefill_breakdown, on_first_byte
            )
        finally:
            self.metrics.leg_seconds.labels(leg).observe(time.monotonic() - sent_s)


async def _first_response(
    d_task: asyncio.Task[aiohttp.ClientResponse], p_task: asyncio.Task[dict[str, Any]]
) -> aiohttp.ClientResponse:
    """D's response headers, unless P fails first (then P's RouteError)."""
    done, _ = await asyncio.wait({d_task, p_task}, return_when=asyncio.FIRST_COMPLETED)
    if d_task not in done:
        p_task.result()  # raises P's error; if P succeeded, keep waiting for D
    return await d_task


def _constant(value: dict[str, Any] | None) -> BreakdownSource:
    async def source() -> dict[str, Any] | None:
        return value

    return source


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's exception so asyncio does not log it as never retrieved."""
    if task.done() and not task.cancelled():
        task.exception()


def make_app(cfg: RouterConfig, *, client_max_size: int | None = None) -> web.Application:
    """The router as an aiohttp app; serve it with `start_server` (it sets handler cancellation
    so a client disconnect reaches the legs). Bodies over `client_max_size` bytes (default:
    cfg.max_request_bytes) get a 413; with cfg.api_key, the OpenAI API needs it as a bearer."""
    router = Router(cfg)
    middlewares = [error_middleware, api_key_middleware(cfg.api_key)]
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
    add_membership_routes(app, router.pool, cfg.cluster_token)
    return app


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0 = any free port); returns the runner (call `cleanup()`) and port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()  # stops the poller and closes the session started by setup()
        raise
    bound_port = port or int(runner.addresses[0][1])
    return runner, bound_port
