"""The pull flow: P's leg first, then D's, to a decode instance chosen once P is done; for our
instances and for vLLM's NixlConnector alike (vllm_params.py: what vLLM's legs say).

Owns moving a pull handoff through its stages (PREFILLING -> LEASED <-> SENT -> DONE) and ending
it once, whatever ends the request; what ending it at each stage undoes is handoff.py's table.
Must not send a leg itself (legs.py) nor choose a flow (flows.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from disagg.protocol import KVTransferParams
from disagg.router.call import Call, WireParams
from disagg.router.handoff import Handoff, Stage
from disagg.router.instances import LATE_BINDING_TIMEOUT_S, Instance, InstancePool
from disagg.router.legs import Legs
from disagg.router.policy import NoHealthyInstanceError
from disagg.router.relay import BreakdownSource, Relayed, RouteError, breakdown_of
from disagg.router.retry import RetryBudget
from disagg.router.vllm_params import VLLMParams

__all__ = ["PullFlow"]


@dataclass(frozen=True, slots=True)
class _Prefilled:
    """Pull: P's answer, on its way to a decode instance."""

    handoff: Handoff  # LEASED: P holds the prompt's blocks under a lease
    d_params: WireParams  # D's leg: P's kv_transfer_params, for the pull connector
    breakdown: dict[str, Any] | None  # P's part of the TTFT breakdown


class PullFlow:
    """P first; D is chosen only once P is done, from load read now (late binding)."""

    def __init__(self, legs: Legs, pool: InstancePool) -> None:
        self.legs = legs
        self.pool = pool

    async def run(self, call: Call, retries: RetryBudget) -> Relayed:
        """P's leg, then D's; the handoff is ended at the stage the request stops at (P's
        lease released at once while no decode instance can read it, after D's fence once
        D may have the leg; nothing undone once the client has its answer)."""
        if not self.pool.has_healthy("decode"):
            # Prefilling now would hold P's blocks for a handoff nobody can take.
            raise NoHealthyInstanceError("no healthy decode instance")
        _, prefilled = await self.legs.retrying(
            call, "prefill", retries, lambda inst: self._prefill(inst, call)
        )
        try:
            relayed = await self._decode(call, prefilled, retries)
            if relayed.status < 400:  # else the client left, or D failed mid-stream
                prefilled.handoff.advance(Stage.DONE)
            return relayed
        finally:
            prefilled.handoff.end(self.legs)

    async def _prefill(self, inst: Instance, call: Call) -> _Prefilled:
        """Pull's P leg, to an answer carrying valid kv_transfer_params for D. Ending without
        them in hand, the handoff ends PREFILLING (P may have leased blocks nobody will read)
        unless P never took the leg."""
        handoff = Handoff(call.request_id, inst, Stage.PREFILLING, lease_id=call.request_id)
        is_vllm = inst.is_vllm
        ours = KVTransferParams(do_remote_decode=True, connector="pull")
        params = VLLMParams.prefill() if is_vllm else ours
        try:
            answer = await self.legs.prefill(inst, call, params)
            d_params = _vllm_params_of(answer) if is_vllm else _kv_params_of(answer)
        except BaseException as exc:
            if isinstance(exc, RouteError) and (exc.unsent or 400 <= exc.status < 500):
                handoff.advance(Stage.REFUSED)
            handoff.end(self.legs)
            raise
        if isinstance(d_params, KVTransferParams):
            handoff.lease_id = d_params.remote_request_id or call.request_id
            d_params = replace(d_params, connector="pull")
        handoff.advance(Stage.LEASED)
        return _Prefilled(handoff, d_params, breakdown_of(answer))

    async def _decode(self, call: Call, prefilled: _Prefilled, retries: RetryBudget) -> Relayed:
        """D's leg, relayed to the client; a 4xx from D (only for a request its engine never
        took) leaves P's lease unread."""
        started_s = time.monotonic()
        resp = await self._send_decode(call, prefilled, retries)
        p_breakdown = _constant(prefilled.breakdown)
        try:
            return await self.legs.respond(call, resp, "decode", started_s, p_breakdown)
        except RouteError as exc:
            if 400 <= exc.status < 500:
                prefilled.handoff.advance(Stage.LEASED)
            raise

    async def _send_decode(
        self, call: Call, prefilled: _Prefilled, retries: RetryBudget
    ) -> aiohttp.ClientResponse:
        """D's leg to a decode instance picked now, to its response headers; a leg that never
        reached its instance goes to another pick while the budget lasts."""
        handoff, body = prefilled.handoff, call.body_with(prefilled.d_params)
        wait_s = 0.0
        while True:
            handoff.decode = await self._bind_decode(wait_s)
            handoff.advance(Stage.SENT)
            try:
                return await self.legs.send(handoff.decode, call, body, "decode")
            except RouteError as exc:
                if exc.unsent:  # D never saw it
                    handoff.advance(Stage.LEASED)
                wait_s = self.legs.retry_wait(call, exc, retries)
                if wait_s is None:
                    raise

    async def _bind_decode(self, wait_s: float) -> Instance:
        """After `wait_s` (a retry's backoff), D picked from load read now."""
        await asyncio.sleep(wait_s)
        if self.pool.uses_load:
            await self.pool.refresh_load(self.pool.decode, LATE_BINDING_TIMEOUT_S)
        return self.pool.pick("decode")


def _kv_params_of(answer: dict[str, Any]) -> KVTransferParams:
    """P's kv_transfer_params, checked. Without them D would silently prefill again: fail
    loudly instead."""
    raw = answer.get("kv_transfer_params")
    if not isinstance(raw, dict) or not raw:
        raise RouteError.of(502, "prefill answer has no kv_transfer_params", leg="prefill")
    try:
        return KVTransferParams.from_dict(raw)
    except (TypeError, ValueError) as exc:
        message = f"prefill answer has invalid kv_transfer_params: {exc}"
        raise RouteError.of(502, message, leg="prefill") from exc


def _vllm_params_of(answer: dict[str, Any]) -> VLLMParams:
    """vLLM P's kv_transfer_params, checked before D's leg carries them: a D leg lacking a
    field vLLM's decode side indexes kills its engine core."""
    try:
        return VLLMParams.from_prefill_answer(answer.get("kv_transfer_params"))
    except ValueError as exc:
        message = f"vLLM prefill answer has unusable kv_transfer_params: {exc}"
        raise RouteError.of(502, message, leg="prefill") from exc


def _constant(value: dict[str, Any] | None) -> BreakdownSource:
    async def source() -> dict[str, Any] | None:
        return value

    return source
