"""The push flow: P and D chosen together and sent their legs at once, P writing into D's blocks,
for our instances and for vLLM's NixlPushConnector alike (vllm_params.py: what vLLM's legs say).

Owns forming a pair (a fresh transfer id naming both), relaying D's stream while P's answer is
still on its way, and ending the pair's handoff (PAIRED -> DONE | PREFILL_FAILED |
DECODE_FAILED) so that neither leg outlives the request; handoff.py's table says what ending
it at each stage undoes. Must not send a leg itself (legs.py) nor choose a flow (flows.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp

from disagg.router.call import Call, WireParams, push_params
from disagg.router.handoff import Handoff, Stage
from disagg.router.identity import VLLMIdentity
from disagg.router.instances import Instance, InstancePool, PoolName
from disagg.router.legs import Legs, consume
from disagg.router.relay import Relayed, RouteError, breakdown_of
from disagg.router.retry import RetryBudget
from disagg.router.vllm_params import VLLMParams

__all__ = ["PushFlow"]

PREFILL_ANSWER_GRACE_S = 2.0  # push: D is done; how long its final chunk waits for P's breakdown


@dataclass(frozen=True, slots=True)
class _Pair:
    """Push: both legs of one attempt, in flight."""

    handoff: Handoff  # PAIRED, holding each leg's task
    sent_s: float  # monotonic, when both legs went out: D's leg is timed from it

    @property
    def p_task(self) -> asyncio.Task[dict[str, Any]]:  # P's leg, to its JSON answer
        return self.handoff.in_flight["prefill"]

    @property
    def d_task(self) -> asyncio.Task[aiohttp.ClientResponse]:  # D's leg, to its headers
        return self.handoff.in_flight["decode"]


class PushFlow:
    """One pair at a time; a pair whose leg never reached its instance is formed anew."""

    def __init__(self, legs: Legs, pool: InstancePool) -> None:
        self.legs = legs
        self.pool = pool

    async def run(self, call: Call, retries: RetryBudget) -> Relayed:
        """A leg that never reached its instance fails the pair (P and D name each other): the
        pair is formed anew from fresh picks, under a fresh transfer id and a fresh request id
        (the first pair's legs are aborted under theirs)."""
        attempt = call
        while True:
            try:
                return await self._run_pair(attempt)
            except RouteError as exc:
                wait_s = self.legs.retry_wait(call, exc, retries)
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)
            attempt = call.retry(f"{call.request_id}-retry{retries.num_retries}")

    async def _run_pair(self, call: Call) -> Relayed:
        """Both legs at once, keyed by a fresh transfer id; D's stream is relayed as it comes.
        The pair's handoff is ended at the stage the request stops at (handoff.py)."""
        pair = await self._send_pair(call)
        try:
            d_resp = await _first_response(pair.d_task, pair.p_task)
            relayed = await self._relay(call, pair, d_resp)
        except BaseException as exc:  # a leg failed; or cancelled: the client left, or stopping
            pair.handoff.advance(_failed(exc if isinstance(exc, RouteError) else None))
            raise
        else:
            pair.handoff.advance(Stage.DONE if relayed.status < 400 else _failed(relayed.error))
        finally:
            pair.handoff.end(self.legs)
            self._settle(pair)
        return relayed

    async def _send_pair(self, call: Call) -> _Pair:
        prefill, decode = self.legs.pick("prefill", call), self.pool.pick("decode")
        p_params, d_params = await self._pair_params(call, prefill, decode)
        sent_s = time.monotonic()
        p_task = asyncio.create_task(self.legs.prefill(prefill, call, p_params))
        d_body = call.body_with(d_params)
        d_task = asyncio.create_task(self.legs.send(decode, call, d_body, "decode"))
        in_flight: dict[PoolName, asyncio.Task[Any]] = {"prefill": p_task, "decode": d_task}
        handoff = Handoff(call.request_id, prefill, Stage.PAIRED, decode, in_flight=in_flight)
        return _Pair(handoff, sent_s)

    async def _pair_params(
        self, call: Call, prefill: Instance, decode: Instance
    ) -> tuple[WireParams, WireParams]:
        """(P's, D's) params for one dispatch. Ours: keyed by a fresh transfer id, each leg
        naming the other instance. vLLM's: paired by the X-Request-Id both legs carry (the
        router's id, fresh for every dispatch and every pair formed anew), D's naming P."""
        info = await self.legs.kv_identity(prefill, "prefill")
        d_info = await self.legs.kv_identity(decode, "decode")
        if info.engine != d_info.engine:  # the pool lets one kind in; a restart may change it
            raise RouteError.of(502, f"{prefill.url} is a {info.engine} instance and "
                                f"{decode.url} a {d_info.engine} one", leg="decode")  # fmt: skip
        if isinstance(info, VLLMIdentity):
            return VLLMParams.prefill(), VLLMParams.push_decode(info, call.request_id)
        assert info.engine_id and info.kv_host and info.kv_port is not None  # is_addressable
        transfer_id = uuid.uuid4().hex
        return push_params(transfer_id, info.engine_id, info.kv_host, info.kv_port,
                           d_info.engine_id)  # fmt: skip

    async def _relay(self, call: Call, pair: _Pair, d_resp: aiohttp.ClientResponse) -> Relayed:
        """D's answer to the client, P's breakdown merged in; P failing ends D's read."""
        p_task = pair.p_task

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
            return await self.legs.respond(call, d_resp, "decode", pair.sent_s, prefill_breakdown)
        finally:
            p_task.remove_done_callback(fail_decode_read)

    def _settle(self, pair: _Pair) -> None:
        """Whatever the stage, free what the legs' tasks hold: D's response, closed (a no-op
        once relayed); a task still running (being cancelled, or P's answer still on its way
        once D is done), left to finish with the other background work."""
        p_task, d_task = pair.p_task, pair.d_task
        if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
            d_task.result().close()
        elif not d_task.done():
            self.legs.keep(d_task)
        if p_task.done():
            consume(p_task)
        else:
            self.legs.keep(p_task)


def _failed(error: RouteError | None) -> Stage:
    """The stage a pair ends at when `error` ends it (None: no leg's error, e.g. cancelled)."""
    if error is not None and error.leg == "prefill":
        return Stage.PREFILL_FAILED
    return Stage.DECODE_FAILED


async def _first_response(
    d_task: asyncio.Task[aiohttp.ClientResponse], p_task: asyncio.Task[dict[str, Any]]
) -> aiohttp.ClientResponse:
    """D's response headers, unless P fails first (then P's RouteError)."""
    done, _ = await asyncio.wait({d_task, p_task}, return_when=asyncio.FIRST_COMPLETED)
    if d_task not in done:
        p_task.result()  # raises P's error; if P succeeded, keep waiting for D
    return await d_task
