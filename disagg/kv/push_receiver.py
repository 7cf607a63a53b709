"""Decode side of push: the reservations that prefill instances write into.

The engine loop hands over the blocks it reserved (`reserve`), a call thread registers them
with P (handshake first on first contact), P's `write_done` (listener thread) ends it. One that
failed (deadline, registration) or was aborted keeps its blocks until P confirms (`/kv/cancel`,
or P gone) that no write can land, then reports them `settled`. No I/O on the engine loop.

    ACTIVE --(write_done | write_failed)------------------------------> removed
      |--(deadline | registration failed)--> FAILED --(abort)--.
      '--(abort)------------------------------------------------> CANCELLING --(cancel)--> removed
"""

from __future__ import annotations

import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from disagg.engine.kv_connector import KVReceive
from disagg.engine.outputs import KVFailure
from disagg.kv.common import HandshakeError, post_json

__all__ = ["PushReceiver", "ReservationState"]


class ReservationState(enum.Enum):
    ACTIVE = "active"  # waiting for P's write
    FAILED = "failed"  # deadline passed or registration failed: the scheduler will abort it
    CANCELLING = "cancelling"  # aborted: waits for P to confirm no write can land


@dataclass(slots=True, eq=False)
class _Reservation:
    request_id: str
    transfer_id: str
    local_ids: list[int]
    first_block: int  # prompt block local_ids[0] stands for: we reused the ones before it
    prefill_url: str
    deadline: float
    state: ReservationState = ReservationState.ACTIVE
    loop_blocked_s: float = 0.0  # engine-loop time this handoff took (the reservation)
    registered: Future[None] = field(default_factory=Future)  # the registration call


class PushReceiver:
    def __init__(self, base: Any) -> None:
        self._base = base  # the PushWorker: config, side channel, calls, stats, report()
        self._lock = threading.Lock()  # the loop, call threads and the listener share these
        self._reservations: dict[str, _Reservation] = {}  # transfer id -> reservation
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id

    # ------------------------------------------------------------------ engine loop

    def reserve(self, receive: KVReceive) -> None:
        """Hand the reserved blocks to a call thread, which registers them with P."""
        started = time.perf_counter()
        base, params = self._base, receive.params
        tid, engine = params.transfer_id, params.remote_engine_id
        host, port = params.remote_host, params.remote_port
        if not (tid and engine and host and port):
            reason = "push needs transfer_id, remote_engine_id, remote_host and remote_port"
            base.report(failed=(receive.request_id, KVFailure(reason)))
            return
        reservation = _Reservation(
            request_id=receive.request_id,
            transfer_id=tid,
            local_ids=list(receive.block_ids),
            first_block=receive.first_block,
            prefill_url=base.side_url(host, port),
            deadline=time.monotonic() + base.kv_config.reservation_timeout_s,
        )
        with self._lock:
            self._reservations[tid] = reservation
            self._transfer_of[receive.request_id] = tid
        peer = base.ensure_peer(engine, host, port)
        # Registrations run side by side (a slow one holds up no other); a cancel waits for
        # its own registration (see abort).
        reservation.registered = base.calls.submit(self._register, reservation, peer)
        reservation.loop_blocked_s += time.perf_counter() - started

    def expire(self, now: float) -> None:
        """Fail every active reservation past its deadline (the scheduler then aborts it)."""
        with self._lock:
            expired = [r for r in self._reservations.values()
                       if r.state is ReservationState.ACTIVE and r.deadline < now]  # fmt: skip
            for reservation in expired:
                reservation.state = ReservationState.FAILED
        timeout = self._base.kv_config.reservation_timeout_s
        for reservation in expired:
            self._base.stats["expired_reservations"] += 1
            reason = f"no KV from the prefill instance within {timeout}s"
            self._base.report(failed=(reservation.request_id, self._base.failure(reason)))

    def abort(self, request_id: str) -> bool:
        """True if a write into the request's blocks may still land: it reports `settled`
        once P confirmed it will not."""
        with self._lock:
            tid = self._transfer_of.pop(request_id, None)
            reservation = self._reservations.get(tid) if tid is not None else None
            if reservation is None:
                return False  # already settled (done, failed, or never registered)
            reservation.state = ReservationState.CANCELLING
        # After the registration call ends, however it ends: a cancel that overtook it would
        # leave P with a registration nobody will cancel.
        reservation.registered.add_done_callback(
            lambda _: self._base.calls.submit(self._cancel, reservation)
        )
        return True

    def blocks_in_use(self) -> set[int]:
        with self._lock:
            return {b for r in self._reservations.values() for b in r.local_ids}

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._reservations)

    def pending(self) -> dict[str, int]:
        with self._lock:
            return {"reservations": len(self._reservations)}

    # ------------------------------------------------------------------ call threads

    def _register(self, reservation: _Reservation, peer: Future[str]) -> None:
        """Tell P where to write. Failures fail the request by policy."""
        base = self._base
        if base.faults.register_delay_s:
            time.sleep(base.faults.register_delay_s)  # a drill's slow decode instance
        try:
            peer.result(timeout=base.kv_config.reservation_timeout_s)
        except (HandshakeError, TimeoutError) as exc:
            self._fail(reservation, f"KV handshake with the prefill instance failed: {exc}")
            return
        with self._lock:
            if reservation.state is not ReservationState.ACTIVE:
                return  # gave up meanwhile: registering now would invite a write nobody awaits
        body = {
            "transfer_id": reservation.transfer_id,
            "engine_id": base.engine_id,
            "request_id": reservation.request_id,
            "block_ids": reservation.local_ids,
            "first_block": reservation.first_block,  # P writes its blocks from this one on
            # P keeps the registration as long as we keep the reservation, however long its
            # own queue and prefill take.
            "ttl_s": base.kv_config.reservation_timeout_s,
        }
        try:
            url = f"{reservation.prefill_url}/kv/register"
            post_json(url, body, secret=base.secret, context=base.side_tls)
        except HandshakeError as exc:
            # P may have taken the registration before the answer was lost, so a write may
            # still come: fail the request, and let the cancel settle the blocks.
            self._fail(reservation, f"KV registration with the prefill instance failed: {exc}")

    def _fail(self, reservation: _Reservation, reason: str) -> None:
        with self._lock:
            is_active = reservation.state is ReservationState.ACTIVE
            if is_active:
                reservation.state = ReservationState.FAILED  # the abort that follows cancels
        if is_active:
            self._base.report(failed=(reservation.request_id, self._base.failure(reason)))

    def _cancel(self, reservation: _Reservation) -> None:
        """After our registration call ended: make sure P will not write, then let the
        scheduler free the blocks."""
        base = self._base
        try:
            post_json(
                f"{reservation.prefill_url}/kv/cancel",
                {"transfer_id": reservation.transfer_id},
                timeout_s=base.kv_config.transfer_timeout_s + 5,
                secret=base.secret,
                context=base.side_tls,
            )
        except HandshakeError:
            pass  # P is gone (nothing can land) or refused: either way no write will come
        with self._lock:
            self._reservations.pop(reservation.transfer_id, None)
        base.report(settled=reservation.request_id)

    # ------------------------------------------------------------------ listener thread

    def on_write_done(self, message: dict[str, Any]) -> None:
        reservation = self._end(str(message.get("transfer_id")))
        if reservation is None:
            return  # cancelled: the cancel's answer settles it
        base, num_blocks = self._base, len(reservation.local_ids)
        num_descriptors = int(message.get("num_descriptors", 0))
        transfer_s = max(0.0, time.time() - float(message.get("posted_wall", 0.0)))
        stages = {
            "handoff_setup_s": float(message.get("setup_s", 0.0)),
            "transfer_s": transfer_s,
            "num_descriptors": num_descriptors,
            "num_bytes": num_blocks * base.block_nbytes,
            "loop_blocked_s": reservation.loop_blocked_s,
        }
        base.count_transfer(num_blocks, num_descriptors, transfer_s)
        first = base.first_token_or_none(message.get("first_token_id"))
        request_id = reservation.request_id
        base.report(
            received=request_id,
            first_token=(request_id, first) if first is not None else None,
            breakdown=(request_id, stages),
        )

    def on_write_failed(self, message: dict[str, Any]) -> None:
        reservation = self._end(str(message.get("transfer_id")))  # P's write has settled
        if reservation is not None:
            reason = f"prefill instance could not write the KV: {message.get('reason')}"
            self._base.report(failed=(reservation.request_id, self._base.failure(reason)))

    def _end(self, tid: str) -> _Reservation | None:
        """Remove an active reservation P has settled; None if there is none."""
        with self._lock:
            reservation = self._reservations.get(tid)
            if reservation is None or reservation.state is not ReservationState.ACTIVE:
                return None
            del self._reservations[tid]
            self._transfer_of.pop(reservation.request_id, None)
        return reservation
