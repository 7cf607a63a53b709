"""Push (early binding), as vLLM's push connector, SGLang and Mooncake do it.

Decode side: reserve blocks on arrival and register them with P from a background thread
(handshake first on first contact); learn completion from P's `write_done` notification, a
cheap poll on the engine loop. A reservation that P never fills fails after a deadline, and its
blocks stay held until P confirms (or is gone) that no write can still land.
Prefill side: a `kv-push-writer` thread matches registrations with finished prefills in either
order, posts the WRITE the moment both are known (the peer was connected while prefill ran),
polls it, and frees P's blocks when it settles. Neither engine loop ever blocks on a transfer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from disagg.engine.outputs import KVConnectorOutput
from disagg.engine.request import Request, RequestStatus
from disagg.kv.common import ConnectorBase, HandshakeError, post_json
from disagg.kv.handshake import encode_message
from disagg.kv.transport import Op, TransferState, TransportError

__all__ = ["PushConnector"]

_NOT_SENT = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
_WRITER_POLL_S = 0.0005  # writer thread poll period while writes are in flight
_NOTIFY_POLL_S = 0.0005  # decode side: slowest poll for write_done while a reservation waits


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, eq=False)
class _Reservation:  # decode side
    request: Request
    transfer_id: str
    local_ids: list[int]
    prefill_url: str
    deadline: float
    state: str = "active"  # active -> (timed_out) -> cancelling; removed when settled


@dataclass(slots=True, eq=False)
class _Ready:  # prefill side: prefill done, blocks held
    request_id: str
    block_ids: list[int]
    first_token_id: int
    ready_s: float


@dataclass(slots=True, eq=False)
class _Registration:  # prefill side: where the decode instance wants the KV
    peer: str
    block_ids: list[int]
    received_s: float
    expires_s: float  # D gives up its reservation by then


@dataclass(slots=True, eq=False)
class _Write:  # prefill side: a posted WRITE
    request_id: str
    transfer_id: str
    peer: str
    handle: int | None  # None while the writer is posting it
    num_blocks: int
    posted_s: float
    aborted: bool = False
    waiters: list[Any] = field(default_factory=list)  # cancel requests awaiting the settle


class PushConnector(ConnectorBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before the base starts the listener thread, which calls has_pending().
        self._reservations: dict[str, _Reservation] = {}  # decode: transfer id -> reservation
        self._ready: dict[str, _Ready] = {}  # prefill: transfer id -> finished prefill
        self._regs: dict[str, _Registration] = {}  # prefill: transfer id -> D's blocks
        self._writes: dict[str, _Write] = {}  # prefill: transfer id -> WRITE in flight
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id (both sides)
        super().__init__(*args, **kwargs)
        if self.role == "decode":
            # P's write_done is on the TTFT path here: poll for it at least every 0.5 ms.
            self.listen_cap_s = _NOTIFY_POLL_S
        self._wakeup = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        if self.role == "prefill":
            self._writer = threading.Thread(target=self._write_loop, name="kv-push-writer")
            self._writer.daemon = True
            self._writer.start()

    def http_routes(self) -> list[web.RouteDef]:
        return [
            *super().http_routes(),
            web.post("/kv/register", self._handle_register),
            web.post("/kv/cancel", self._handle_cancel),
        ]

    # ================================================================== decode side

    def get_num_new_matched_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens if request.needs_remote_kv else 0

    def on_blocks_allocated(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
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
            self.report(failed=(request.request_id, reason))
            return
        num_blocks = _cdiv(request.num_prompt_tokens, self.block_size)
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
        self._control.submit(self._register, reservation, peer)

    def _register(self, reservation: _Reservation, peer: Any) -> None:
        """Control thread: tell P where to write. Failures fail the request by policy."""
        request_id = reservation.request.request_id
        delay = self.kv_config.register_delay_s
        if delay:
            time.sleep(delay)  # fault injection: a slow decode instance
        try:
            peer.result(timeout=self.kv_config.reservation_timeout_s)
            post_json(
                f"{reservation.prefill_url}/kv/register",
                {
                    "transfer_id": reservation.transfer_id,
                    "engine_id": self.engine_id,
                    "request_id": request_id,
                    "block_ids": reservation.local_ids,
                    # P keeps the registration as long as we keep the reservation, however
                    # long its own queue and prefill take.
                    "ttl_s": self.kv_config.reservation_timeout_s,
                },
            )
        except (HandshakeError, TimeoutError) as exc:
            with self._lock:
                active = self._reservations.pop(reservation.transfer_id, None) is not None
                self._transfer_of.pop(request_id, None)
            if active:  # nothing was registered, so nothing can land: fail cleanly
                self.report(
                    failed=(
                        request_id,
                        self.failure_reason(
                            f"KV registration with the prefill instance failed: {exc}"
                        ),
                    )
                )

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
        first = message.get("first_token_id")
        self.report(
            received=request.request_id,
            first_token=(request.request_id, int(first)) if first is not None else None,
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
        self.report(failed=(reservation.request.request_id, self.failure_reason(reason)))

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
            self.report(failed=(reservation.request.request_id, self.failure_reason(reason)))

    def _cancel(self, reservation: _Reservation) -> None:
        """Control thread (after our registration, FIFO): make sure P will not write, then
        let the scheduler free the blocks."""
        try:
            post_json(
                f"{reservation.prefill_url}/kv/cancel",
                {"transfer_id": reservation.transfer_id},
                timeout_s=self.kv_config.transfer_timeout_s + 5,
            )
        except HandshakeError:
            pass  # P is gone (nothing can land) or refused: either way no write will come
        with self._lock:
            self._reservations.pop(reservation.transfer_id, None)
        self.report(failed=(reservation.request.request_id, "settled"))

    # ================================================================== prefill side

    def request_finished(self, request: Request) -> tuple[bool, dict[str, object] | None]:
        params = request.kv_transfer_params
        if not request.is_remote_decode or request.finish_status in _NOT_SENT:
            return False, None
        tid = params.transfer_id if params else None
        if not tid:
            return False, None
        num_blocks = _cdiv(request.num_prompt_tokens, self.block_size)
        ready = _Ready(
            request_id=request.request_id,
            block_ids=request.block_ids[:num_blocks],
            first_token_id=request.output_token_ids[0],
            ready_s=time.monotonic(),
        )
        with self._wakeup:
            self._ready[tid] = ready
            self._transfer_of[request.request_id] = tid
            key = "registrations_before_ready" if tid in self._regs else "registrations_after_ready"
            self.stats[key] += 1
            self._wakeup.notify()
        return True, {
            "transfer_id": tid,
            "remote_engine_id": self.engine_id,
            "num_prompt_tokens": request.num_prompt_tokens,
            "first_token_id": request.output_token_ids[0],
            "connector": "push",
        }

    async def _handle_register(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            tid, peer = str(body["transfer_id"]), str(body["engine_id"])
            block_ids = [int(b) for b in body["block_ids"]]
            ttl_s = float(body.get("ttl_s", self.kv_config.lease_s))
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"bad registration: {exc}")
        with self._wakeup:
            now = time.monotonic()
            self._regs[tid] = _Registration(peer, block_ids, now, now + ttl_s)
            self._wakeup.notify()
        return web.json_response({"status": "registered"})

    async def _handle_cancel(self, request: web.Request) -> web.Response:
        try:
            tid = str((await request.json())["transfer_id"])
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"bad cancel: {exc}")
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[str] = loop.create_future()
        with self._wakeup:
            write = self._writes.get(tid)
            if write is not None:
                write.waiters.append(lambda: loop.call_soon_threadsafe(_resolve, settled, "done"))
            else:
                self._regs.pop(tid, None)
                settled.set_result("dropped")
        state = await asyncio.wait_for(settled, self.kv_config.transfer_timeout_s + 5)
        return web.json_response({"state": state})

    def _write_loop(self) -> None:
        while not self._stopping.is_set():
            with self._wakeup:
                jobs = self._take_pairs()
                busy = bool(self._writes)
                if not jobs and not busy:
                    self._wakeup.wait(0.05)
            for write, ready, reg in jobs:
                self._post_write(write, ready, reg)
            self._poll_writes()
            self._expire_leases(time.monotonic())
            if busy:
                self._stopping.wait(_WRITER_POLL_S)

    def _take_pairs(self) -> list[tuple[_Write, _Ready, _Registration]]:
        """With the lock held: claim every transfer whose two halves are known. The claim is
        visible in `_writes` before the lock drops, so a cancel waits for it to settle."""
        jobs = []
        for tid in [t for t in self._ready if t in self._regs]:
            ready, reg = self._ready.pop(tid), self._regs.pop(tid)
            write = _Write(ready.request_id, tid, reg.peer, None, len(ready.block_ids), 0.0)
            self._writes[tid] = write
            jobs.append((write, ready, reg))
        return jobs

    def _post_write(self, write: _Write, ready: _Ready, reg: _Registration) -> None:
        started = time.monotonic()
        message = encode_message(
            "write_done",
            transfer_id=write.transfer_id,
            first_token_id=ready.first_token_id,
            setup_s=started - max(ready.ready_s, reg.received_s),
            posted_wall=time.time(),
            num_descriptors=len(ready.block_ids),
        )
        try:
            if len(reg.block_ids) != len(ready.block_ids):
                raise TransportError(
                    f"decode registered {len(reg.block_ids)} blocks, "
                    f"prefill has {len(ready.block_ids)}"
                )
            if self.kv_config.fault == "fail_transfer":
                raise TransportError("injected transfer failure (fault=fail_transfer)")
            handle = self.transport.post(
                Op.WRITE, reg.peer, ready.block_ids, reg.block_ids, message
            )
        except TransportError as exc:
            self._settle_write(write, ok=False, reason=str(exc))
            return
        self.stats["post_s_total"] += time.monotonic() - started
        write.posted_s = started
        write.handle = handle

    def _poll_writes(self) -> None:
        with self._lock:
            writes = [w for w in self._writes.values() if w.handle is not None]
        for write in writes:
            assert write.handle is not None
            state = self.transport.poll(write.handle)
            if state is TransferState.PROC:
                continue
            self.transport.release(write.handle)
            if state is TransferState.DONE:
                seconds = time.monotonic() - write.posted_s
                self.count_transfer(write.num_blocks, write.num_blocks, seconds)
            self._settle_write(write, ok=state is TransferState.DONE, reason="transfer error")

    def _settle_write(self, write: _Write, *, ok: bool, reason: str) -> None:
        with self._lock:
            self._writes.pop(write.transfer_id, None)
            self._transfer_of.pop(write.request_id, None)
            waiters = list(write.waiters)
        if ok:
            self.report(sent=write.request_id)
        else:
            self._write_failed(write.transfer_id, write.peer, write.request_id, reason)
        for wake in waiters:
            wake()

    def _write_failed(self, tid: str, peer: str, request_id: str, reason: str) -> None:
        self.stats["transfers_failed"] += 1
        try:
            self.transport.send_notif(
                peer, encode_message("write_failed", transfer_id=tid, reason=reason)
            )
        except TransportError:
            pass  # the decode instance is gone; its reservation deadline covers it
        self.report(sent=request_id)  # P's blocks are free either way

    def _expire_leases(self, now: float) -> None:
        lease = self.kv_config.lease_s
        with self._lock:
            stale = [tid for tid, r in self._ready.items() if now - r.ready_s > lease]
            expired = [self._ready.pop(tid) for tid in stale]
            for ready in expired:
                self._transfer_of.pop(ready.request_id, None)
            for tid in [t for t, r in self._regs.items() if now > r.expires_s]:
                del self._regs[tid]  # its prefill never came, and D has given up on it
        for ready in expired:
            self.stats["expired_leases"] += 1
            self.report(sent=ready.request_id)

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
        with self._wakeup:
            tid = self._transfer_of.pop(request.request_id, None)
            if tid is None:
                return False
            if self.role == "prefill":
                return self._abort_prefill_side(tid)
            reservation = self._reservations.get(tid)
            if reservation is None:
                return False  # already settled (done, failed, or never registered)
            reservation.state = "cancelling"
        self._control.submit(self._cancel, reservation)
        return True

    def _abort_prefill_side(self, tid: str) -> bool:
        """Called with the lock held."""
        write = self._writes.get(tid)
        if write is not None:
            write.aborted = True
            return True  # the writer reports it when the WRITE settles
        self._ready.pop(tid, None)
        reg = self._regs.pop(tid, None)
        if reg is not None:  # tell D now rather than at its deadline
            message = encode_message("write_failed", transfer_id=tid, reason="prefill aborted")
            self._control.submit(self.notify_quietly, reg.peer, message)
        return False

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._reservations or self._ready or self._writes)

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
        with self._lock:
            info["pending"] = {
                "reservations": len(self._reservations),
                "ready": len(self._ready),
                "registrations": len(self._regs),
                "writes": len(self._writes),
            }
        return info


def _resolve(future: asyncio.Future[str], value: str) -> None:
    if not future.done():
        future.set_result(value)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "kv_error", "code": status}}, status=status
    )
