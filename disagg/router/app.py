"""The router's HTTP app: parse a client request, ask the policy, proxy the legs, stream back.

Owns the three request flows (aggregated, pull, push), aborting the other leg when one fails,
releasing a pull lease no decode instance will read, and resending legs that never reached their
instance; call.py shapes the legs' bodies, admission.py / retry.py / breaker.py hold the limits,
metrics.py the counters. Must not rank instances (policy.py) nor poll them (instances.py), and
never buffers a stream: SSE events are relayed as they arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)

from disagg import auth
from disagg.config import HEADER_TIMEOUT_S, RouterConfig
from disagg.http_guard import GuardedRunner, body_deadline_middleware
from disagg.protocol import KV_RELEASE_PATH
from disagg.router.admission import Admission
from disagg.router.call import Call, kv_params, parse_call, prefill_body, push_params
from disagg.router.instances import (
    LATE_BINDING_TIMEOUT_S,
    Instance,
    InstancePool,
    KVInfo,
    PoolName,
)
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
    error_object,
    read_all,
    relay,
)
from disagg.router.retry import RetryBudget
from disagg.tls import client_context

__all__ = ["Router", "make_app", "start_server"]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
ABORT_TIMEOUT_S = 2.0
PREFILL_ANSWER_GRACE_S = 2.0  # push: D is done; how long its final chunk waits for P's breakdown
# Answers that say the instance failed, not the request: they count against its circuit breaker.
_INSTANCE_FAILURES = frozenset({502, 503, 504})

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Handoff:
    """Pull: P's answer on its way to a decode instance."""

    prefill: Instance  # holds the prompt's blocks under a lease
    lease_id: str  # P's name for the lease (remote_request_id), what /kv/release takes
    body: dict[str, Any]  # D's leg: the client's body with P's kv_transfer_params


class Router:
    """The flows. One per app; `session` lives from startup to cleanup."""

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
        # No limit: the instances, not the router, set concurrency. An https instance's
        # certificate must chain to the internal CA when one is configured (disagg.tls).
        connector = aiohttp.TCPConnector(limit=0, ssl=client_context(self.cfg.tls_ca_file) or True)
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
            call = await parse_call(request, request_id, self.cfg.max_prompt_chars or None)
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
        """The request's flow, once admitted (it holds its slot until relayed); under policy
        recompute a failed prefill leg becomes a whole request to a decode instance."""
        async with self.admission.slot():
            retries = RetryBudget.of(self.cfg)
            try:
                try:
                    return await self._flow(call, retries)
                except RouteError as exc:
                    if not self._should_recompute(exc):
                        raise
                    return await self._recompute_on_decode(call, exc, retries)
            except NoHealthyInstanceError as exc:
                raise RouteError.of(503, str(exc)) from exc

    async def _flow(self, call: Call, retries: RetryBudget) -> Relayed:
        if self.cfg.mode == "pull":
            return await self._pull(call, retries)
        if self.cfg.mode == "push":
            return await self._push(call, retries)
        return await self._aggregated(call, retries)

    def _should_recompute(self, exc: RouteError) -> bool:
        """Policy `recompute`: a prefill instance that died or hung (5xx, nothing streamed yet)
        costs the client its disaggregation, not its answer, and so does having no healthy
        prefill instance at all. A 4xx is the request's fault."""
        return (
            self.cfg.failure_policy == "recompute"
            and self.cfg.mode != "aggregated"
            and exc.leg == "prefill"
            and exc.status >= 500
        )

    async def _recompute_on_decode(
        self, call: Call, cause: RouteError, retries: RetryBudget
    ) -> Relayed:
        """The whole request to a decode instance, which prefills it itself. A fresh id: the
        abandoned legs' ids may still be held while their aborts land."""
        logger.warning("request %s: prefill leg failed (%s); prefilling on a decode instance",
                       call.request_id, cause)  # fmt: skip
        self.metrics.recomputed.inc()
        local = call.retry(f"{call.request_id}-local")
        started_s = time.monotonic()
        _, resp = await self._retrying(
            local, "decode", retries, lambda inst: self._send(inst, local, local.body, "decode")
        )
        return await self._respond(local, resp, "decode", started_s, None)

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

    async def _aggregated(self, call: Call, retries: RetryBudget) -> Relayed:
        started_s = time.monotonic()
        _, resp = await self._retrying(
            call, "decode", retries, lambda inst: self._send(inst, call, call.body, "aggregated")
        )
        return await self._respond(call, resp, "aggregated", started_s, None)

    async def _pull(self, call: Call, retries: RetryBudget) -> Relayed:
        """P first; D is chosen only once P is done, from load read now (late binding).

        P's lease on the prompt's blocks is released (with an abort) as soon as no decode
        instance can read it: while D's leg is not out yet (client gone, P failed), and when D
        never got the leg or refused it (4xx). Once D may be reading, P is only aborted: D's
        read_done, D's own release or the lease's end frees the blocks."""
        if not self.pool.has_healthy("decode"):
            # Prefilling now would hold P's blocks for a handoff nobody can take.
            raise NoHealthyInstanceError("no healthy decode instance")
        prefill, answer = await self._retrying(
            call, "prefill", retries, lambda inst: self._pull_prefill(inst, call)
        )
        d_params = answer["kv_transfer_params"]
        handoff = _Handoff(
            prefill=prefill,
            lease_id=str(d_params.get("remote_request_id") or call.request_id),
            body=call.body_with({**d_params, "connector": "pull"}),
        )
        started_s = time.monotonic()
        resp = await self._send_handoff(call, handoff, retries)
        p_breakdown = _constant(breakdown_of(answer))
        try:
            relayed = await self._respond(call, resp, "decode", started_s, p_breakdown)
        except RouteError as exc:  # D answered 4xx: only for a request its engine never took
            self._end_handoff(call, handoff, is_unread=400 <= exc.status < 500)
            raise
        except asyncio.CancelledError:
            self._end_handoff(call, handoff, is_unread=False)
            raise
        if relayed.status >= 400:  # the client left, or D failed mid-stream
            self._end_handoff(call, handoff, is_unread=False)
        return relayed

    async def _pull_prefill(self, inst: Instance, call: Call) -> dict[str, Any]:
        """Pull's P leg, to an answer carrying the kv_transfer_params D needs. Ending without
        them in hand (client gone, P failed or sent none), P may still have finished and leased
        blocks nobody will read: it is aborted, and released under the id we sent it (which P
        resolves to its own)."""
        params = kv_params(do_remote_decode=True, connector="pull")
        try:
            answer = await self._prefill(inst, call, params)
            d_params = answer.get("kv_transfer_params")
            if not isinstance(d_params, dict) or not d_params:
                # Without them D would silently prefill again: fail loudly instead.
                raise RouteError.of(502, "prefill answer has no kv_transfer_params", leg="prefill")
        except (RouteError, asyncio.CancelledError) as exc:
            is_refused = isinstance(exc, RouteError) and (exc.unsent or 400 <= exc.status < 500)
            if not is_refused:  # unsent, or refused with a 4xx: P took nothing
                self._abort(inst, call.request_id)
                self._release(inst, call.request_id)
            raise
        return answer

    async def _send_handoff(
        self, call: Call, handoff: _Handoff, retries: RetryBudget
    ) -> aiohttp.ClientResponse:
        """D's leg, to its response headers; one that never reached its instance goes to
        another pick while the budget lasts. Ending here, P's lease is released unless D may
        have the leg (then only P is aborted)."""
        wait_s = 0.0
        while True:
            decode = await self._bind_decode(call, handoff, wait_s)
            try:
                return await self._send(decode, call, handoff.body, "decode")
            except RouteError as exc:
                wait_s = self._retry_wait(call, exc, retries)
                if wait_s is None:
                    self._end_handoff(call, handoff, is_unread=exc.unsent)
                    raise
            except asyncio.CancelledError:
                self._end_handoff(call, handoff, is_unread=False)  # D may have it
                raise

    async def _bind_decode(self, call: Call, handoff: _Handoff, wait_s: float) -> Instance:
        """After `wait_s` (a retry's backoff), D picked from load read now. Nothing has
        reached a decode instance yet, so whatever ends the request here (client gone, no
        healthy instance) releases P's lease."""
        try:
            await asyncio.sleep(wait_s)
            if self.pool.uses_load:
                await self.pool.refresh_load(self.pool.decode, LATE_BINDING_TIMEOUT_S)
            return self.pool.pick("decode")
        except BaseException:
            self._end_handoff(call, handoff, is_unread=True)
            raise

    def _end_handoff(self, call: Call, handoff: _Handoff, *, is_unread: bool) -> None:
        """Pull: abort P's request (its blocks go before the lease would let them), and when
        no decode instance read P's answer, release the lease too: an abort alone keeps it,
        since reads are one-sided."""
        self._abort(handoff.prefill, call.request_id)
        if is_unread:
            self._release(handoff.prefill, handoff.lease_id)

    async def _push(self, call: Call, retries: RetryBudget) -> Relayed:
        """One pair at a time. A leg that never reached its instance fails the pair (P and D
        name each other): the pair is formed anew from fresh picks, under a fresh transfer id
        and a fresh request id (the first pair's legs are aborted under theirs)."""
        attempt = call
        while True:
            try:
                return await self._push_pair(attempt)
            except RouteError as exc:
                wait_s = self._retry_wait(call, exc, retries)
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)
            attempt = call.retry(f"{call.request_id}-retry{retries.num_retries}")

    async def _push_pair(self, call: Call) -> Relayed:
        """Both legs at once, keyed by a fresh transfer id; D's stream is relayed as it comes."""
        prefill, decode = self._pick("prefill"), self.pool.pick("decode")
        info = await self._kv_identity(prefill, "prefill")
        d_info = await self._kv_identity(decode, "decode")
        assert info.engine_id and info.kv_host and info.kv_port is not None  # is_addressable
        p_params, d_params = push_params(
            uuid.uuid4().hex, info.engine_id, info.kv_host, info.kv_port, d_info.engine_id
        )
        started_s = time.monotonic()
        p_task = asyncio.create_task(self._prefill(prefill, call, p_params))
        d_task = asyncio.create_task(self._send(decode, call, call.body_with(d_params), "decode"))
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
            error = RouteError.of(502, f"no kv_info from {inst.url}: {exc!r}", leg=leg)
            if isinstance(exc, aiohttp.ClientConnectorError):  # gone: no leg was sent yet
                self.pool.mark_unhealthy(inst, repr(exc))
                error.unsent = True
            raise error from exc
        if not info.is_addressable:
            raise RouteError.of(502, f"{inst.url} has no KV address for push", leg=leg)
        return info

    async def _prefill(self, inst: Instance, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        """The P leg, to its JSON answer. Raises RouteError(leg="prefill") on any failure."""
        started_s = time.monotonic()
        resp = await self._send(inst, call, prefill_body(call.body, params), "prefill")
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

    def _pick(self, pool: PoolName) -> Instance:
        """The policy's choice. No healthy prefill instance is the prefill leg's failure (503),
        which policy recompute answers on a decode instance like any other."""
        if pool == "decode":
            return self.pool.pick("decode")
        try:
            return self.pool.pick("prefill")
        except NoHealthyInstanceError as exc:
            raise RouteError.of(503, str(exc), leg="prefill") from exc

    async def _retrying(
        self,
        call: Call,
        pool: PoolName,
        retries: RetryBudget,
        send: Callable[[Instance], Awaitable[T]],
    ) -> tuple[Instance, T]:
        """`send` the leg to the policy's pick from `pool`. A leg that never reached its
        instance (so nothing of it went to the client) goes to another pick after a backoff,
        while the request's budget lasts and some other instance is healthy."""
        inst = self._pick(pool)
        while True:
            try:
                return inst, await send(inst)
            except RouteError as exc:
                wait_s = self._retry_wait(call, exc, retries)
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)
            inst = self._pick(pool)

    def _retry_wait(self, call: Call, exc: RouteError, retries: RetryBudget) -> float | None:
        """The backoff before resending the failed leg, or None when it must not be: it
        reached its instance, the budget is spent, or no other instance is left to try."""
        leg = exc.leg or "decode"
        if not exc.unsent or not self.pool.has_healthy("prefill" if leg == "prefill" else "decode"):
            return None
        wait_s = retries.take()
        if wait_s is not None:
            self.metrics.retries.labels(leg).inc()
            logger.warning("request %s: the %s leg never reached its instance; resent in %.3gs",
                           call.request_id, leg, wait_s)  # fmt: skip
        return wait_s

    async def _send(
        self, inst: Instance, call: Call, body: dict[str, Any], leg: Leg
    ) -> aiohttp.ClientResponse:
        """`_post`, and the outcome for the instance's circuit breaker: served if its headers
        came with any status but 502/503/504; failed if those, or no answer at all."""
        try:
            resp = await self._post(inst, call, body, leg)
        except RouteError as exc:
            self._note_failed(inst, str(exc))
            raise
        if resp.status in _INSTANCE_FAILURES:
            self._note_failed(inst, f"answered {resp.status}")
        else:
            self.pool.note_served(inst)
        return resp

    def _note_failed(self, inst: Instance, reason: str) -> None:
        if self.pool.note_failed(inst, reason):
            self.metrics.breaker_opened.labels(inst.role, inst.url).inc()

    async def _post(
        self, inst: Instance, call: Call, body: dict[str, Any], leg: Leg = "decode"
    ) -> aiohttp.ClientResponse:
        """Send one leg; returns once the instance's headers arrive."""
        url = f"{inst.url}{call.path}"
        data = json.dumps(body).encode()
        headers = {**call.upstream_headers, **self._signature(url, data, call.request_id)}
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
        self._keep(asyncio.create_task(self._post_internal(inst, KV_RELEASE_PATH, request_id)))

    async def _post_internal(self, inst: Instance, path: str, request_id: str) -> None:
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
        url, data = f"{inst.url}{path}", json.dumps({"request_id": request_id}).encode()
        headers = self._signature(url, data)
        try:
            async with self.session.post(url, data=data, headers=headers, timeout=timeout) as resp:
                logger.info("%s %s on %s: %s", path, request_id, inst.url, resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("%s %s on %s failed: %r", path, request_id, inst.url, exc)

    def _signature(self, url: str, data: bytes, request_id: str = "") -> dict[str, str]:
        """Headers that make a leg a cluster call: instances accept kv_transfer_params and
        aborts only when signed with the cluster token, for them, once (a fresh nonce each
        time: a retry is signed anew). `request_id`: the X-Request-Id the leg carries."""
        return auth.json_headers(self.cfg.cluster_token, url, data, request_id=request_id)

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
