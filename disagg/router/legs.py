"""The router's outgoing HTTP: one leg to one instance, and the cluster calls around it.

Owns the client session, which instance a leg goes to (the policy's pick) and when a leg that
never reached its instance goes again, each leg's signature and circuit-breaker outcome, the
relay of the leg that answers the client, and the aborts and lease releases sent in the
background. Must not decide a request's flow (flows.py) nor rank instances (policy.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from disagg.config import RouterConfig
from disagg.protocol import KV_RELEASE_PATH
from disagg.router.call import Call, WireParams, prefill_body
from disagg.router.identity import Identity
from disagg.router.instances import Instance, InstancePool, PoolName
from disagg.router.metrics import RouterMetrics
from disagg.router.policy import NoHealthyInstanceError
from disagg.router.relay import BreakdownSource, Leg, Relay, Relayed, RouteError, read_all
from disagg.router.retry import RetryBudget
from disagg.security import auth
from disagg.security.tls import client_context

__all__ = ["ABORT_TIMEOUT_S", "CONNECT_TIMEOUT_S", "Legs", "consume"]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
ABORT_TIMEOUT_S = 2.0
# Answers that say the instance failed, not the request: they count against its circuit breaker.
_INSTANCE_FAILURES = frozenset({502, 503, 504})

T = TypeVar("T")


class Legs:
    """Sends the legs of every request. Lifecycle: `start()` opens the session, `close()`
    lets the background calls land (bounded) and closes it."""

    def __init__(self, cfg: RouterConfig, pool: InstancePool, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "router used before startup"
        return self._session

    def start(self) -> None:
        timeout = aiohttp.ClientTimeout(
            total=self.cfg.request_timeout_s, sock_connect=CONNECT_TIMEOUT_S
        )
        # No limit: the instances, not the router, set concurrency. An https instance's
        # certificate must chain to the internal CA when one is configured (disagg.security.tls).
        connector = aiohttp.TCPConnector(limit=0, ssl=client_context(self.cfg.tls_ca_file) or True)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close(self) -> None:
        if self._background:  # aborts in flight: let them land, bounded
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        for task in list(self._background):
            task.cancel()
        await self.session.close()

    # ---- where a leg goes -----------------------------------------------------------------

    def pick(self, pool: PoolName, call: Call | None = None) -> Instance:
        """The policy's choice (for `call`'s prompt, when kv_aware weighs cached prefixes). No
        healthy prefill instance is the prefill leg's failure (503), which policy recompute
        answers on a decode instance like any other."""
        prompt_ids = call.prompt_ids if call is not None else None
        if pool == "decode":
            return self.pool.pick("decode", prompt_ids)
        try:
            return self.pool.pick("prefill", prompt_ids)
        except NoHealthyInstanceError as exc:
            raise RouteError.of(503, str(exc), leg="prefill") from exc

    async def retrying(
        self,
        call: Call,
        pool: PoolName,
        retries: RetryBudget,
        send: Callable[[Instance], Awaitable[T]],
    ) -> tuple[Instance, T]:
        """`send` the leg to the policy's pick from `pool`. A leg that never reached its
        instance (so nothing of it went to the client) goes to another pick after a backoff,
        while the request's budget lasts and some other instance is healthy."""
        inst = self.pick(pool, call)
        while True:
            try:
                return inst, await send(inst)
            except RouteError as exc:
                wait_s = self.retry_wait(call, exc, retries)
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)
            inst = self.pick(pool, call)

    def retry_wait(self, call: Call, exc: RouteError, retries: RetryBudget) -> float | None:
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

    # ---- one leg --------------------------------------------------------------------------

    async def kv_identity(self, inst: Instance, leg: Leg) -> Identity:
        """The instance's identity (cached), its KV side channel known: push names it."""
        try:
            info = await self.pool.get_identity(inst)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            error = RouteError.of(502, f"no KV identity from {inst.url}: {exc!r}", leg=leg)
            if isinstance(exc, aiohttp.ClientConnectorError):  # gone: no leg was sent yet
                self.pool.mark_unhealthy(inst, repr(exc))
                error.unsent = True
            raise error from exc
        # vLLM's decode side tells P its own address in its registration; ours is named.
        if not info.is_addressable and (leg == "prefill" or info.engine == "disagg"):
            raise RouteError.of(502, f"{inst.url} has no KV address for push", leg=leg)
        return info

    async def prefill(self, inst: Instance, call: Call, params: WireParams) -> dict[str, Any]:
        """The P leg, to its JSON answer. Raises RouteError(leg="prefill") on any failure."""
        started_s = time.monotonic()
        resp = await self.send(inst, call, prefill_body(call.body, params), "prefill")
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

    async def send(
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

    async def respond(
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
            return await Relay(
                call.request, resp, leg, call.request_id, prefill_breakdown, on_first_byte
            ).run()
        finally:
            self.metrics.leg_seconds.labels(leg).observe(time.monotonic() - sent_s)

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

    # ---- cluster calls in the background --------------------------------------------------

    def abort(self, inst: Instance, request_id: str) -> None:
        """POST /v1/abort in the background: it must land even if this handler is cancelled.
        vLLM has no such route: dropping a leg's connection is its abort, which the handoff's
        cut (or the cancelled handler) already did."""
        if inst.is_vllm:
            return
        self.keep(asyncio.create_task(self._post_internal(inst, "/v1/abort", request_id)))

    def release(self, inst: Instance, request_id: str) -> None:
        """Pull: tell P that no decode instance read its lease, so the blocks go now. vLLM
        has no such route: its lease ends on its own (30 s), or when D's abort tells P."""
        if inst.is_vllm:
            return
        self.keep(asyncio.create_task(self._post_internal(inst, KV_RELEASE_PATH, request_id)))

    def fence_then_release(
        self, decode: Instance, request_id: str, prefill: Instance, lease_id: str
    ) -> None:
        """Pull, D's leg sent but the request over: abort it on D with a fence, and when D
        answers that it never took the request (so it never will), release P's lease, which
        nobody else would (D may have been cut off while reading the leg). When D holds the
        request, or the answer does not come, D's own release or the lease's end frees it.
        vLLM fences nothing: the cut leg was its abort, and P's lease ends on its own."""
        if decode.is_vllm:
            return
        self.keep(
            asyncio.create_task(self._fence_then_release(decode, request_id, prefill, lease_id))
        )

    async def _fence_then_release(
        self, decode: Instance, request_id: str, prefill: Instance, lease_id: str
    ) -> None:
        answer = await self._post_internal(decode, "/v1/abort", request_id, {"fence": True})
        if isinstance(answer, dict) and answer.get("fenced") is True:
            await self._post_internal(prefill, KV_RELEASE_PATH, lease_id)

    def keep(self, task: asyncio.Task[Any]) -> None:
        """Hold `task` until it ends (`close()` waits for it), its exception retrieved."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(consume)

    async def _post_internal(
        self, inst: Instance, path: str, request_id: str, extra: dict[str, Any] | None = None
    ) -> Any:
        """POST {"request_id", **extra}. With `extra` the caller acts on the answer: it is
        read, its signature checked, and returned as JSON (None when it failed); without,
        only the status is logged."""
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
        url = f"{inst.url}{path}"
        data = json.dumps({"request_id": request_id, **(extra or {})}).encode()
        headers = self._signature(url, data)
        try:
            async with self.session.post(url, data=data, headers=headers, timeout=timeout) as resp:
                logger.info("%s %s on %s: %s", path, request_id, inst.url, resp.status)
                if extra is None or resp.status != 200:
                    return None
                raw = await resp.read()
                self._check_answer(headers, resp, raw)
                return json.loads(raw)
        except (aiohttp.ClientError, TimeoutError, ValueError, auth.SignatureError) as exc:
            logger.warning("%s %s on %s failed: %r", path, request_id, inst.url, exc)
            return None

    def _check_answer(
        self, headers: dict[str, str], resp: aiohttp.ClientResponse, raw: bytes
    ) -> None:
        """An answer we act on (a fence lets us free P's blocks) must be the instance's own
        answer to this call: raises SignatureError otherwise. Nothing to check unsigned."""
        if not self.cfg.cluster_token:
            return
        nonce = auth.Signature.parse(headers[auth.SIGNATURE_HEADER]).nonce
        answer_signature = resp.headers.get(auth.SIGNATURE_HEADER)
        auth.check_answer(self.cfg.cluster_token, answer_signature, nonce, resp.status, raw)

    def _signature(self, url: str, data: bytes, request_id: str = "") -> dict[str, str]:
        """Headers that make a leg a cluster call: instances accept kv_transfer_params and
        aborts only when signed with the cluster token, for them, once (a fresh nonce each
        time: a retry is signed anew). `request_id`: the X-Request-Id the leg carries."""
        return auth.json_headers(self.cfg.cluster_token, url, data, request_id=request_id)


def consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's exception so asyncio does not log it as never retrieved."""
    if task.done() and not task.cancelled():
        task.exception()
