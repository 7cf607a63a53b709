"""Prefill side of push: the `kv-push-writer` thread that writes each finished prefill's KV
into the blocks its decode instance registered.

Registrations (D's block ids, over HTTP) and finished prefills (from the engine loop) arrive in
either order; the WRITE is posted the moment both halves are known, polled here, and P's blocks
are released (`report(sent=...)`) when it settles. It never runs on an engine loop.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from disagg.engine.kv_connector import KVSend, source_blocks
from disagg.kv.common import ConnectorBase
from disagg.kv.handshake import encode_message
from disagg.kv.transport import Op, TransferState, TransportError

__all__ = ["CancelOutcome", "PushWriter"]

_WRITER_POLL_S = 0.0005  # poll period while writes are in flight
_IDLE_WAIT_S = 0.05  # nothing to pair or poll: sleep until an input arrives


class CancelOutcome(enum.StrEnum):
    """How a `/kv/cancel` ended (its answer's `state`): either way no write can land now."""

    DONE = "done"  # a write was in flight and has settled
    DROPPED = "dropped"  # no write had started: the registration is forgotten


@dataclass(slots=True, eq=False)
class _Ready:  # prefill done, blocks held
    request_id: str
    block_ids: list[int]
    first_token_id: int
    ready_s: float
    decode_engine_id: str | None  # the decode instance the router chose; None = any


@dataclass(slots=True, eq=False)
class _Registration:  # where the decode instance wants the KV
    peer: str
    block_ids: list[int]
    received_s: float
    expires_s: float  # D gives up its reservation by then
    first_block: int = 0  # our prompt block block_ids[0] takes: D reused the ones before


@dataclass(slots=True, eq=False)
class _Write:  # a posted WRITE
    request_id: str
    transfer_id: str
    peer: str
    handle: int | None  # None while the writer is posting it
    block_ids: list[int]  # ours, held until the WRITE settles
    posted_s: float
    num_moved: int = 0  # blocks the WRITE moves (D reused the leading ones it skips)
    is_aborted: bool = False  # the request is gone: its blocks are `settled`, not `sent`
    waiters: list[Callable[[], None]] = field(default_factory=list)  # cancels awaiting settle


class PushWriter:
    def __init__(self, base: ConnectorBase, control: Executor, stopping: threading.Event) -> None:
        self._base = base  # transport, config, stats and the engine-loop report queue
        self._control = control  # FIFO to peers, shared with the decode side
        self._stopping = stopping
        self._lock = threading.Condition()
        self._ready: dict[str, _Ready] = {}  # transfer id -> finished prefill
        self._regs: dict[str, _Registration] = {}  # transfer id -> D's blocks
        self._writes: dict[str, _Write] = {}  # transfer id -> WRITE in flight
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id
        self._thread = threading.Thread(target=self._loop, name="kv-push-writer", daemon=True)

    def start(self) -> None:
        """Start the `kv-push-writer` thread; it ends when `stopping` is set."""
        self._thread.start()

    # ------------------------------------------------------------------ inputs

    def prefill_done(self, send: KVSend) -> None:
        """Engine loop: the prefill finished; its blocks stay held until the write settles.
        Only the decode instance the router named (`remote_engine_id`) may take the KV."""
        tid, decode_engine_id = send.params.transfer_id, send.params.remote_engine_id
        assert tid, "push sends only prefills with a transfer id (PushScheduler.accepts)"
        blocks = list(send.block_ids)
        with self._lock:
            now = time.monotonic()
            self._ready[tid] = _Ready(
                send.request_id, blocks, send.first_token_id, now, decode_engine_id
            )
            self._transfer_of[send.request_id] = tid
            key = "registrations_before_ready" if tid in self._regs else "registrations_after_ready"
            self._base.stats[key] += 1
            self._lock.notify()

    def register(
        self, tid: str, peer: str, block_ids: list[int], ttl_s: float, first_block: int = 0
    ) -> None:
        """HTTP handler: D reserved `block_ids` for our prompt blocks from `first_block` on
        and keeps them for `ttl_s`."""
        with self._lock:
            now = time.monotonic()
            self._regs[tid] = _Registration(peer, block_ids, now, now + ttl_s, first_block)
            self._lock.notify()

    async def cancel(self, tid: str, timeout_s: float) -> CancelOutcome:
        """HTTP handler: answers once no write for `tid` can land in D's blocks any more."""
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[CancelOutcome] = loop.create_future()
        done = CancelOutcome.DONE
        with self._lock:
            write = self._writes.get(tid)
            if write is not None:
                write.waiters.append(lambda: loop.call_soon_threadsafe(_resolve, settled, done))
            else:
                self._regs.pop(tid, None)
                settled.set_result(CancelOutcome.DROPPED)
        return await asyncio.wait_for(settled, timeout_s)

    def abort(self, request_id: str) -> bool:
        """Engine loop: True if a WRITE is in flight (it reports the request when it settles)."""
        with self._lock:
            tid = self._transfer_of.pop(request_id, None)
            if tid is None:
                return False
            write = self._writes.get(tid)
            if write is not None:
                write.is_aborted = True
                return True
            self._ready.pop(tid, None)
            reg = self._regs.pop(tid, None)
        if reg is not None:  # tell D now rather than at its deadline
            message = encode_message("write_failed", transfer_id=tid, reason="prefill aborted")
            self._control.submit(self._base.notify_quietly, reg.peer, message)
        return False

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._ready or self._writes)

    def blocks_in_use(self) -> set[int]:
        """Our blocks that a WRITE reads now or will (the prefill side's are held as
        WAITING_FOR_KV_SEND, or in `draining` once aborted)."""
        with self._lock:
            ready = [b for r in self._ready.values() for b in r.block_ids]
            return {*ready, *(b for w in self._writes.values() for b in w.block_ids)}

    def pending(self) -> dict[str, int]:
        with self._lock:
            return {"ready": len(self._ready), "registrations": len(self._regs),
                    "writes": len(self._writes)}  # fmt: skip

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                jobs = self._take_pairs()
                busy = bool(self._writes)
                if not jobs and not busy:
                    self._lock.wait(_IDLE_WAIT_S)
            for write, ready, reg in jobs:
                self._post(write, ready, reg)
            self._poll()
            self._expire(time.monotonic())
            if busy:
                self._stopping.wait(_WRITER_POLL_S)

    def _take_pairs(self) -> list[tuple[_Write, _Ready, _Registration]]:
        """With the lock held: claim every transfer whose two halves are known. The claim is
        visible in `_writes` before the lock drops, so a cancel waits for it to settle."""
        jobs = []
        for tid in [t for t in self._ready if t in self._regs]:
            expected = self._ready[tid].decode_engine_id
            if expected is not None and self._regs[tid].peer != expected:
                # Not the instance the router chose: a stale or forged registration. Drop it
                # and keep waiting for the right one (or the lease).
                self._base.stats["registrations_refused"] += 1
                del self._regs[tid]
                continue
            ready, reg = self._ready.pop(tid), self._regs.pop(tid)
            write = _Write(ready.request_id, tid, reg.peer, None, ready.block_ids, 0.0)
            self._writes[tid] = write
            jobs.append((write, ready, reg))
        return jobs

    def _post(self, write: _Write, ready: _Ready, reg: _Registration) -> None:
        started = time.monotonic()
        # D holds the blocks before first_block in its own cache.
        source = source_blocks(ready.block_ids, reg.first_block, len(reg.block_ids))
        message = encode_message(
            "write_done",
            transfer_id=write.transfer_id,
            first_token_id=ready.first_token_id,
            setup_s=started - max(ready.ready_s, reg.received_s),
            posted_wall=time.time(),
            num_descriptors=len(source),
        )
        base = self._base
        try:
            if not source or len(ready.block_ids) != reg.first_block + len(reg.block_ids):
                raise TransportError(
                    f"decode registered {len(reg.block_ids)} blocks from block "
                    f"{reg.first_block}, prefill has {len(ready.block_ids)}"
                )
            base.faults.check_transfer()
            handle = base.transport.post(Op.WRITE, reg.peer, source, reg.block_ids, message)
        except TransportError as exc:
            self._settle(write, ok=False, reason=str(exc))
            return
        base.stats["post_s_total"] += time.monotonic() - started
        write.posted_s = started
        write.num_moved = len(source)
        write.handle = handle

    def _poll(self) -> None:
        with self._lock:
            writes = [w for w in self._writes.values() if w.handle is not None]
        transport = self._base.transport
        for write in writes:
            assert write.handle is not None
            state = transport.poll(write.handle)
            if state is TransferState.PROC:
                continue
            transport.release(write.handle)
            if state is TransferState.DONE:
                seconds = time.monotonic() - write.posted_s
                self._base.count_transfer(write.num_moved, write.num_moved, seconds)
            self._settle(write, ok=state is TransferState.DONE, reason="transfer error")

    def _settle(self, write: _Write, *, ok: bool, reason: str) -> None:
        with self._lock:
            self._writes.pop(write.transfer_id, None)
            self._transfer_of.pop(write.request_id, None)
            waiters = list(write.waiters)
        if not ok:
            self._base.stats["transfers_failed"] += 1
            message = encode_message("write_failed", transfer_id=write.transfer_id, reason=reason)
            # A decode instance that is gone has its reservation deadline to cover it.
            self._base.notify_quietly(write.peer, message)
        if write.is_aborted:
            self._base.report(settled=write.request_id)  # the blocks wait in `draining`
        else:
            self._base.report(sent=write.request_id)  # P's blocks are free either way
        for wake in waiters:
            wake()

    def _expire(self, now: float) -> None:
        lease = self._base.kv_config.lease_s
        with self._lock:
            stale = [tid for tid, r in self._ready.items() if now - r.ready_s > lease]
            expired = [self._ready.pop(tid) for tid in stale]
            for ready in expired:
                self._transfer_of.pop(ready.request_id, None)
            for tid in [t for t, r in self._regs.items() if now > r.expires_s]:
                del self._regs[tid]  # its prefill never came, and D has given up on it
        for ready in expired:
            self._base.stats["expired_leases"] += 1
            self._base.report(sent=ready.request_id)


def _resolve(future: asyncio.Future[CancelOutcome], value: CancelOutcome) -> None:
    if not future.done():
        future.set_result(value)
