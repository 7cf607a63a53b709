"""The pull flow: P's leg first, then D's, to a decode instance chosen once P is done.

Owns the handoff between the legs (P's lease on the prompt's blocks) and ending it: P is
aborted, and its lease released when no decode instance can read it. Must not send a leg
itself (legs.py) nor choose a flow (flows.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from disagg.router.call import Call, kv_params
from disagg.router.instances import LATE_BINDING_TIMEOUT_S, Instance, InstancePool
from disagg.router.legs import Legs
from disagg.router.policy import NoHealthyInstanceError
from disagg.router.relay import BreakdownSource, Relayed, RouteError, breakdown_of
from disagg.router.retry import RetryBudget

__all__ = ["PullFlow"]


@dataclass(frozen=True, slots=True)
class _Handoff:
    """Pull: P's answer on its way to a decode instance."""

    prefill: Instance  # holds the prompt's blocks under a lease
    lease_id: str  # P's name for the lease (remote_request_id), what /kv/release takes
    body: dict[str, Any]  # D's leg: the client's body with P's kv_transfer_params


class PullFlow:
    """P first; D is chosen only once P is done, from load read now (late binding)."""

    def __init__(self, legs: Legs, pool: InstancePool) -> None:
        self.legs = legs
        self.pool = pool

    async def run(self, call: Call, retries: RetryBudget) -> Relayed:
        """P's lease on the prompt's blocks is released (with an abort) as soon as no decode
        instance can read it: while D's leg is not out yet (client gone, P failed), and when D
        never got the leg or refused it (4xx). Once D may be reading, P is only aborted: D's
        read_done, D's own release or the lease's end frees the blocks."""
        if not self.pool.has_healthy("decode"):
            # Prefilling now would hold P's blocks for a handoff nobody can take.
            raise NoHealthyInstanceError("no healthy decode instance")
        prefill, answer = await self.legs.retrying(
            call, "prefill", retries, lambda inst: self._prefill(inst, call)
        )
        d_params = answer["kv_transfer_params"]
        handoff = _Handoff(
            prefill=prefill,
            lease_id=str(d_params.get("remote_request_id") or call.request_id),
            body=call.body_with({**d_params, "connector": "pull"}),
        )
        started_s = time.monotonic()
        decode, resp = await self._send_handoff(call, handoff, retries)
        p_breakdown = _constant(breakdown_of(answer))
        try:
            relayed = await self.legs.respond(call, resp, "decode", started_s, p_breakdown)
        except RouteError as exc:  # D answered 4xx: only for a request its engine never took
            self._end_handoff(call, handoff, is_unread=400 <= exc.status < 500, decode=decode)
            raise
        except asyncio.CancelledError:
            self._end_handoff(call, handoff, is_unread=False, decode=decode)
            raise
        if relayed.status >= 400:  # the client left, or D failed mid-stream
            self._end_handoff(call, handoff, is_unread=False, decode=decode)
        return relayed

    async def _prefill(self, inst: Instance, call: Call) -> dict[str, Any]:
        """Pull's P leg, to an answer carrying the kv_transfer_params D needs. Ending without
        them in hand (client gone, P failed or sent none), P may still have finished and leased
        blocks nobody will read: it is aborted, and released under the id we sent it (which P
        resolves to its own)."""
        params = kv_params(do_remote_decode=True, connector="pull")
        try:
            answer = await self.legs.prefill(inst, call, params)
            d_params = answer.get("kv_transfer_params")
            if not isinstance(d_params, dict) or not d_params:
                # Without them D would silently prefill again: fail loudly instead.
                raise RouteError.of(502, "prefill answer has no kv_transfer_params", leg="prefill")
        except (RouteError, asyncio.CancelledError) as exc:
            is_refused = isinstance(exc, RouteError) and (exc.unsent or 400 <= exc.status < 500)
            if not is_refused:  # unsent, or refused with a 4xx: P took nothing
                self.legs.abort(inst, call.request_id)
                self.legs.release(inst, call.request_id)
            raise
        return answer

    async def _send_handoff(
        self, call: Call, handoff: _Handoff, retries: RetryBudget
    ) -> tuple[Instance, aiohttp.ClientResponse]:
        """The decode instance and its leg's response headers; a leg that never reached its
        instance goes to another pick while the budget lasts. Ending here, P's lease is
        released at once unless D may have the leg (then once D says it never took it)."""
        wait_s = 0.0
        while True:
            decode = await self._bind_decode(call, handoff, wait_s)
            try:
                return decode, await self.legs.send(decode, call, handoff.body, "decode")
            except RouteError as exc:
                wait_s = self.legs.retry_wait(call, exc, retries)
                if wait_s is None:
                    self._end_handoff(call, handoff, is_unread=exc.unsent, decode=decode)
                    raise
            except asyncio.CancelledError:
                self._end_handoff(call, handoff, is_unread=False, decode=decode)  # D may have it
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

    def _end_handoff(
        self, call: Call, handoff: _Handoff, *, is_unread: bool, decode: Instance | None = None
    ) -> None:
        """Abort P's request (its blocks go before the lease would let them), and when no
        decode instance read P's answer, release the lease too: an abort alone keeps it,
        since reads are one-sided. When `decode` may have P's answer, it is asked to abort
        with a fence, and the lease is released once it says it never took the request (a
        leg cut mid-send, or a handler cancelled before submitting, tells P nothing)."""
        self.legs.abort(handoff.prefill, call.request_id)
        if is_unread:
            self.legs.release(handoff.prefill, handoff.lease_id)
        elif decode is not None:
            self.legs.fence_then_release(decode, call.request_id, handoff.prefill, handoff.lease_id)


def _constant(value: dict[str, Any] | None) -> BreakdownSource:
    async def source() -> dict[str, Any] | None:
        return value

    return source
