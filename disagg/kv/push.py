"""Push (early binding), as vLLM's push connector, SGLang and Mooncake do it, in two halves.

`PushScheduler` (pure): a decode request's reserved blocks become a receive, a finished
prefill with a transfer id a send, for the worker.
`PushWorker` (transport, threads, side channel):
- decode side: register the reserved blocks with P from a call thread (handshake first on
  first contact); learn completion from P's `write_done` notification, a set lookup on the
  loop. A reservation P never fills fails after a deadline, and its blocks stay held until P
  confirms (or is gone) that no write can still land.
- prefill side (push_writer.py): a `kv-push-writer` thread matches registrations with finished
  prefills in either order, posts the WRITE the moment both are known, polls it, and frees P's
  blocks when it settles. Neither engine loop ever blocks on a transfer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from disagg.engine.kv_connector import KVConnectorMeta, KVConnectorScheduler, KVReceive
from disagg.engine.outputs import KVConnectorOutput, KVFailure
from disagg.engine.request import Request
from disagg.kv.common import (
    ConnectorBase,
    HandshakeError,
    KVIdentity,
    SideChannelError,
    SideHandler,
    post_json,
)
from disagg.kv.push_writer import PushWriter
from disagg.protocol import KVTransferParams

__all__ = ["PushScheduler", "PushWorker"]

_MAX_REGISTRATION_TTL_S = 3600.0  # a registration P keeps longer than this is a mistake
_NOTIFY_POLL_S = 0.0005  # decode side: slowest poll for write_done while a reservation waits


# ================================================================== scheduler half (pure)


class PushScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, identity: KVIdentity) -> None:
        super().__init__(block_size)
        self.identity = identity

    def accepts(self, params: KVTransferParams) -> bool:
        return bool(params.transfer_id)  # no transfer id: no decode instance awaits the KV

    def finished_params(self, request: Request, block_ids: list[int], first: int) -> dict[str, Any]:
        assert request.kv_transfer_params is not None
        return {
            "transfer_id": request.kv_transfer_params.transfer_id,
            "remote_engine_id": self.identity.engine_id,
            "num_prompt_tokens": request.num_prompt_tokens,
            "first_token_id": first,
            "connector": "push",
        }


# ================================================================== worker half


@dataclass(slots=True, eq=False)
class _Reservation:  # decode side
    request_id: str
    transfer_id: str
    local_ids: list[int]
    prefill_url: str
    deadline: float
    state: str = "active"  # active -> (timed_out) -> cancelling; removed when settled
    loop_blocked_s: float = 0.0  # engine-loop time this handoff took (the reservation)
    registered: Future[None] = field(default_factory=Future)  # the registration call


class PushWorker(ConnectorBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before the base starts the listener thread, which calls has_pending().
        self._reservations: dict[str, _Reservation] = {}  # transfer id -> reservation
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id
        self._writer: PushWriter | None = None  # the prefill side
        super().__init__(*args, **kwargs)
        if self.role == "decode":
            # P's write_done is on the TTFT path here: poll for it at least every 0.5 ms.
            self.listen_cap_s = _NOTIFY_POLL_S
        elif self.role == "prefill":
            self._writer = PushWriter(self, self._control, self._stopping)

    def side_channel(self) -> dict[str, SideHandler]:
        return {
            **super().side_channel(),
            "/kv/register": self._handle_register,
            "/kv/cancel": self._handle_cancel,
        }

    # ================================================================== decode side

    def _reserve(self, receive: KVReceive) -> None:
        params = receive.params
        tid, engine, host, port = (
            params.transfer_id,
            params.remote_engine_id,
            params.remote_host,
            params.remote_port,
        )
        if not (tid and engine and host and port):
            reason = "push needs transfer_id, remote_engine_id, remote_host and remote_port"
            self.report(failed=(receive.request_id, KVFailure(reason)))
            return
        reservation = _Reservation(
            request_id=receive.request_id,
            transfer_id=tid,
            local_ids=list(receive.block_ids),
            prefill_url=self.side_url(host, port),
            deadline=time.monotonic() + self.kv_config.reservation_timeout_s,
        )
        with self._lock:
            self._reservations[tid] = reservation
            self._transfer_of[receive.request_id] = tid
        peer = self.ensure_peer(engine, host, port)
        # Registrations run side by side (a slow one holds up no other); a cancel waits for
        # its own registration (see _abort_reservation).
        reservation.registered = self.calls.submit(self._register, reservation, peer)

    def _register(self, reservation: _Reservation, peer: Any) -> None:
        """Call thread: tell P where to write. Failures fail the request by policy."""
        delay = self.kv_config.register_delay_s
        if delay:
            time.sleep(delay)  # fault injection: a slow decode instance
        try:
            peer.result(timeout=self.kv_config.reservation_timeout_s)
        except (HandshakeError, TimeoutError) as exc:
            self._registration_failed(
                reservation, f"KV handshake with the prefill instance failed: {exc}"
            )
            return
        with self._lock:
            if reservation.state != "active":
                return  # gave up meanwhile: registering now would invite a write nobody awaits
        try:
            post_json(
                f"{reservation.prefill_url}/kv/register",
                {
                    "transfer_id": reservation.transfer_id,
                    "engine_id": self.engine_id,
                    "request_id": reservation.request_id,
                    "block_ids": reservation.local_ids,
                    # P keeps the registration as long as we keep the reservation, however
                    # long its own queue and prefill take.
                    "ttl_s": self.kv_config.reservation_timeout_s,
                },
                secret=self.secret,
                context=self.side_tls,
            )
        except HandshakeError as exc:
            # P may have taken the registration before the answer was lost, so a write may
            # still come: fail the request, and let the cancel settle the blocks.
            self._registration_failed(
                reservation, f"KV registration with the prefill instance failed: {exc}"
            )

    def _registration_failed(self, reservation: _Reservation, reason: str) -> None:
        with self._lock:
            is_active = reservation.state == "active"
            if is_active:
                reservation.state = "timed_out"  # the scheduler aborts it, and that cancels
        if is_active:
            self.report(failed=(reservation.request_id, self.failure(reason)))

    def _on_write_done(self, message: dict[str, Any]) -> None:
        tid = str(message.get("transfer_id"))
        with self._lock:
            reservation = self._reservations.get(tid)
            if reservation is None or reservation.state != "active":
                return  # cancelled: the cancel's answer settles it
            del self._reservations[tid]
            self._transfer_of.pop(reservation.request_id, None)
        num_descriptors = int(message.get("num_descriptors", 0))
        transfer_s = max(0.0, time.time() - float(message.get("posted_wall", 0.0)))
        stages = {
            "handoff_setup_s": float(message.get("setup_s", 0.0)),
            "transfer_s": transfer_s,
            "num_descriptors": num_descriptors,
            "num_bytes": len(reservation.local_ids) * self.block_nbytes,
            "loop_blocked_s": reservation.loop_blocked_s,
        }
        self.count_transfer(len(reservation.local_ids), num_descriptors, transfer_s)
        first = self.first_token_or_none(message.get("first_token_id"))
        request_id = reservation.request_id
        self.report(
            received=request_id,
            first_token=(request_id, first) if first is not None else None,
            breakdown=(request_id, stages),
        )

    def _on_write_failed(self, message: dict[str, Any]) -> None:
        tid = str(message.get("transfer_id"))
        with self._lock:
            reservation = self._reservations.get(tid)
            if reservation is None or reservation.state != "active":
                return
            del self._reservations[tid]  # P only says so once its write has settled
            self._transfer_of.pop(reservation.request_id, None)
        reason = f"prefill instance could not write the KV: {message.get('reason')}"
        self.report(failed=(reservation.request_id, self.failure(reason)))

    def _expire_reservations(self, now: float) -> None:
        with self._lock:
            expired = [
                r for r in self._reservations.values() if r.state == "active" and r.deadline < now
            ]
            for reservation in expired:
                reservation.state = "timed_out"  # the scheduler will abort it and cancel
        for reservation in expired:
            self.stats["expired_reservations"] += 1
            timeout = self.kv_config.reservation_timeout_s
            reason = f"no KV from the prefill instance within {timeout}s"
            self.report(failed=(reservation.request_id, self.failure(reason)))

    def _cancel(self, reservation: _Reservation) -> None:
        """Call thread (after our registration call ended): make sure P will not write,
        then let the scheduler free the blocks."""
        try:
            post_json(
                f"{reservation.prefill_url}/kv/cancel",
                {"transfer_id": reservation.transfer_id},
                timeout_s=self.kv_config.transfer_timeout_s + 5,
                secret=self.secret,
                context=self.side_tls,
            )
        except HandshakeError:
            pass  # P is gone (nothing can land) or refused: either way no write will come
        with self._lock:
            self._reservations.pop(reservation.transfer_id, None)
        self.report(settled=reservation.request_id)

    # ================================================================== prefill side

    async def _handle_register(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            tid, peer = str(body["transfer_id"]), str(body["engine_id"])
            block_ids = [int(b) for b in body["block_ids"]]
            ttl_s = float(body.get("ttl_s", self.kv_config.lease_s))
        except (ValueError, KeyError, TypeError) as exc:
            raise SideChannelError(400, f"bad registration: {exc}") from exc
        if not 0 < ttl_s <= _MAX_REGISTRATION_TTL_S:  # NaN fails too
            raise SideChannelError(400, f"ttl_s must be in (0, {_MAX_REGISTRATION_TTL_S}]")
        if self._writer is None:
            raise SideChannelError(400, "this instance is not a prefill instance")
        self._writer.register(tid, peer, block_ids, ttl_s)
        return {"status": "registered"}

    async def _handle_cancel(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            tid = str(body["transfer_id"])
        except (KeyError, TypeError) as exc:
            raise SideChannelError(400, f"bad cancel: {exc}") from exc
        if self._writer is None:
            raise SideChannelError(400, "this instance is not a prefill instance")
        return {"state": await self._writer.cancel(tid, self.kv_config.transfer_timeout_s + 5)}

    # ================================================================== both sides

    def start_load(self, meta: KVConnectorMeta) -> None:
        """Engine loop: hand the step's work to the call threads or the writer (no I/O here)."""
        for receive in meta.receives:
            started = time.perf_counter()
            self._reserve(receive)
            self._note_loop_time(receive.request_id, time.perf_counter() - started)
        for send in meta.sends:
            assert self._writer is not None and send.params.transfer_id
            self._writer.prefill_done(
                send.params.transfer_id,
                send.request_id,
                list(send.block_ids),
                send.first_token_id,
                send.params.remote_engine_id,  # only this decode instance may take the KV
            )
        for request_id in meta.aborts:
            if not self._abort(request_id):
                self.report(settled=request_id)  # nothing can land: the blocks go now

    def _note_loop_time(self, request_id: str, seconds: float) -> None:
        with self._lock:
            tid = self._transfer_of.get(request_id)
            reservation = self._reservations.get(tid) if tid is not None else None
            if reservation is not None:
                reservation.loop_blocked_s += seconds

    def get_finished(self) -> KVConnectorOutput:
        if self.role == "decode":
            self._expire_reservations(time.monotonic())
        return self.take_reports()

    def _abort(self, request_id: str) -> bool:
        """True if a write into (or out of) the request's blocks may still be in flight: it
        reports `settled` when it is not."""
        if self._writer is not None:
            return self._writer.abort(request_id)
        with self._lock:
            tid = self._transfer_of.pop(request_id, None)
            reservation = self._reservations.get(tid) if tid is not None else None
            if reservation is None:
                return False  # already settled (done, failed, or never registered)
            reservation.state = "cancelling"
        # After the registration call ends, however it ends: a cancel that overtook it would
        # leave P with a registration nobody will cancel.
        reservation.registered.add_done_callback(
            lambda _: self.calls.submit(self._cancel, reservation)
        )
        return True

    def blocks_in_use(self) -> set[int]:
        if self._writer is not None:
            return self._writer.blocks_in_use()
        with self._lock:
            return {b for r in self._reservations.values() for b in r.local_ids}

    def has_pending(self) -> bool:
        if self._writer is not None:
            return self._writer.has_pending()
        with self._lock:
            return bool(self._reservations)

    def on_message(self, peer: str, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "write_done":
            self._on_write_done(message)
        elif kind == "write_failed":
            self._on_write_failed(message)

    def on_tick(self) -> None:
        return None

    def info(self) -> dict[str, Any]:
        info = super().info()
        if self._writer is not None:
            info["pending"] = self._writer.pending()
        else:
            with self._lock:
                info["pending"] = {"reservations": len(self._reservations)}
        return info
