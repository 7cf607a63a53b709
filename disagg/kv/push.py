"""Push (early binding), as vLLM's push connector, SGLang and Mooncake do it.

Decode side: reserve blocks on arrival and register them with P from a background thread
(handshake first on first contact); learn completion from P's `write_done` notification, a
cheap poll on the engine loop. A reservation that P never fills fails after a deadline, and its
blocks stay held until P confirms (or is gone) that no write can still land.
Prefill side (push_writer.py): a `kv-push-writer` thread matches registrations with finished
prefills in either order, posts the WRITE the moment both are known (the peer was connected
while prefill ran), polls it, and frees P's blocks when it settles. Neither engine loop ever
blocks on a transfer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from disagg.engine.outputs import KVConnectorOutput, KVFailure
from disagg.engine.request import Request
from disagg.kv.common import (
    ConnectorBase,
    HandshakeError,
    SideChannelError,
    SideHandler,
    post_json,
)
from disagg.kv.push_writer import PushWriter

__all__ = ["PushConnector"]

_MAX_REGISTRATION_TTL_S = 3600.0  # a registration P keeps longer than this is a mistake
_NOTIFY_POLL_S = 0.0005  # decode side: slowest poll for write_done while a reservation waits


@dataclass(slots=True, eq=False)
class _Reservation:  # decode side
    request: Request
    transfer_id: str
    local_ids: list[int]
    prefill_url: str
    deadline: float
    state: str = "active"  # active -> (timed_out) -> cancelling; removed when settled
    registered: Future[None] = field(default_factory=Future)  # the registration call


class PushConnector(ConnectorBase):
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

    def get_num_new_matched_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens if request.needs_remote_kv else 0

    def on_blocks_allocated(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        started = time.perf_counter()
        self._reserve(request, block_ids)
        # The only engine-loop work of a push handoff on D (the rest is on other threads).
        request.breakdown.loop_blocked_s = time.perf_counter() - started

    def _reserve(self, request: Request, block_ids: list[int]) -> None:
        params = request.kv_transfer_params
        assert params is not None
        tid, engine, host, port = (
            params.transfer_id,
            params.remote_engine_id,
            params.remote_host,
            params.remote_port,
        )
        if not (tid and engine and host and port):
            reason = "push needs transfer_id, remote_engine_id, remote_host and remote_port"
            self.report(failed=(request.request_id, KVFailure(reason)))
            return
        num_blocks = self.num_prompt_blocks(request)
        reservation = _Reservation(
            request=request,
            transfer_id=tid,
            local_ids=block_ids[:num_blocks],
            prefill_url=f"http://{host}:{port}",
            deadline=time.monotonic() + self.kv_config.reservation_timeout_s,
        )
        with self._lock:
            self._reservations[tid] = reservation
            self._transfer_of[request.request_id] = tid
        peer = self.ensure_peer(engine, host, port)
        # Registrations run side by side (a slow one holds up no other); a cancel waits for
        # its own registration (see request_aborted).
        reservation.registered = self.calls.submit(self._register, reservation, peer)

    def _register(self, reservation: _Reservation, peer: Any) -> None:
        """Call thread: tell P where to write. Failures fail the request by policy."""
        delay = self.kv_config.register_delay_s
        if delay:
            time.sleep(delay)  # fault injection: a slow decode instance
        try:
            peer.result(timeout=self.kv_config.reservation_timeout_s)
        except (HandshakeError, TimeoutError) as exc:
            self._registration_failed(reservation, f"KV handshake failed: {exc}")
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
                    "request_id": reservation.request.request_id,
                    "block_ids": reservation.local_ids,
                    # P keeps the registration as long as we keep the reservation, however
                    # long its own queue and prefill take.
                    "ttl_s": self.kv_config.reservation_timeout_s,
                },
                secret=self.secret,
            )
        except HandshakeError as exc:
            # P may have taken the registration before the answer was lost, so a write may
            # still come: fail the request, and let the cancel settle the blocks.
            self._registration_failed(reservation, f"KV registration failed: {exc}")

    def _registration_failed(self, reservation: _Reservation, reason: str) -> None:
        with self._lock:
            is_active = reservation.state == "active"
            if is_active:
                reservation.state = "timed_out"  # the scheduler aborts it, and that cancels
        if is_active:
            self.report(failed=(reservation.request.request_id, self.failure(reason)))

    def _on_write_done(self, message: dict[str, Any]) -> None:
        tid = str(message.get("transfer_id"))
        with self._lock:
            reservation = self._reservations.get(tid)
            if reservation is None or reservation.state != "active":
                return  # cancelled: the cancel's answer settles it
            del self._reservations[tid]
            self._transfer_of.pop(reservation.request.request_id, None)
        request = reservation.request
        breakdown = request.breakdown
        breakdown.handoff_setup_s = float(message.get("setup_s", 0.0))
        breakdown.transfer_s = max(0.0, time.time() - float(message.get("posted_wall", 0.0)))
        breakdown.num_descriptors = int(message.get("num_descriptors", 0))
        breakdown.num_bytes = len(reservation.local_ids) * self.block_nbytes
        self.count_transfer(
            len(reservation.local_ids), breakdown.num_descriptors, breakdown.transfer_s
        )
        first = self.first_token_or_none(message.get("first_token_id"))
        self.report(
            received=request.request_id,
            first_token=(request.request_id, first) if first is not None else None,
        )

    def _on_write_failed(self, message: dict[str, Any]) -> None:
        tid = str(message.get("transfer_id"))
        with self._lock:
            reservation = self._reservations.get(tid)
            if reservation is None or reservation.state != "active":
                return
            del self._reservations[tid]  # P only says so once its write has settled
            self._transfer_of.pop(reservation.request.request_id, None)
        reason = f"prefill instance could not write the KV: {message.get('reason')}"
        self.report(failed=(reservation.request.request_id, self.failure(reason)))

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
            self.report(failed=(reservation.request.request_id, self.failure(reason)))

    def _cancel(self, reservation: _Reservation) -> None:
        """Call thread (after our registration call ended): make sure P will not write,
        then let the scheduler free the blocks."""
        try:
            post_json(
                f"{reservation.prefill_url}/kv/cancel",
                {"transfer_id": reservation.transfer_id},
                timeout_s=self.kv_config.transfer_timeout_s + 5,
                secret=self.secret,
            )
        except HandshakeError:
            pass  # P is gone (nothing can land) or refused: either way no write will come
        with self._lock:
            self._reservations.pop(reservation.transfer_id, None)
        self.report(settled=reservation.request.request_id)

    # ================================================================== prefill side

    def request_finished(self, request: Request) -> tuple[bool, dict[str, object] | None]:
        params = request.kv_transfer_params
        if not self.sends_kv(request):
            return False, None
        tid = params.transfer_id if params else None
        if not tid or self._writer is None:
            return False, None
        num_blocks = self.num_prompt_blocks(request)
        first_token = request.output_token_ids[0]
        decode_engine = params.remote_engine_id if params else None
        self._writer.prefill_done(
            tid, request.request_id, request.block_ids[:num_blocks], first_token, decode_engine
        )
        return True, {
            "transfer_id": tid,
            "remote_engine_id": self.engine_id,
            "num_prompt_tokens": request.num_prompt_tokens,
            "first_token_id": first_token,
            "connector": "push",
        }

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

    def build_meta(self) -> object:
        return None  # nothing for the engine loop to start: the writer thread does it

    def start_load(self, meta: object) -> None:
        return None

    def get_finished(self) -> KVConnectorOutput:
        if self.role == "decode":
            self._expire_reservations(time.monotonic())
        return self.take_reports()

    def request_aborted(self, request: Request) -> bool:
        if self._writer is not None:
            return self._writer.abort(request.request_id)
        with self._lock:
            tid = self._transfer_of.pop(request.request_id, None)
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
