"""Decode side of pull: the READs of prefill instances' blocks, from descriptors to settle.

One `PullReader` per decode instance holds every load: waiting for its handshake, READ in
flight, or given up but not yet settled (a "zombie": its blocks stay held until the transport
says no byte can land). Where it runs is the deployment's choice (`--pull-setup`):
- inline: the engine loop calls `step()` (vLLM's pull: descriptor preparation and the post
  stall every running decode, the tax the published comparison measures);
- background: its own `kv-pull-reader` thread calls `step()`; the engine loop only hands loads
  over and learns of completions by wake-up, so late binding costs the loop ~nothing.
The time each load keeps the engine loop busy is added to its `breakdown.loop_blocked_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from disagg.kv.handshake import encode_message
from disagg.kv.transport import Op, TransferState, TransportError

__all__ = ["Load", "PullReader"]

log = logging.getLogger(__name__)

_BUSY_POLL_S = 0.0005  # background thread: poll period while READs are in flight
_IDLE_WAIT_S = 0.05  # background thread: nothing to do, sleep until handed a load


@dataclass(slots=True, eq=False)
class Load:
    request_id: str
    local_ids: list[int]
    remote_ids: list[int]
    remote_request_id: str
    prefill_url: str | None  # P's side channel (None when the params lacked it)
    peer: Future[str]
    allocated_s: float
    read_by_s: float | None  # after this P's lease may have freed the blocks: do not read
    handle: int | None = None
    posted_s: float | None = None
    is_aborted: bool = False  # aborted while being posted (the poster settles it)
    # TTFT-breakdown fields this worker measured (handoff_setup_s, transfer_s, loop_blocked_s
    # ...): reported with the outcome, never written into the scheduler's Request from here.
    stages: dict[str, float] = field(default_factory=dict)

    def add_loop_time(self, seconds: float) -> None:
        self.stages["loop_blocked_s"] = self.stages.get("loop_blocked_s", 0.0) + seconds

    def breakdown_of(self) -> tuple[str, dict[str, float]]:
        return self.request_id, dict(self.stages)


class PullReader:
    def __init__(self, base: Any, *, is_background: bool, stopping: threading.Event) -> None:
        self._base = base  # the PullConnector: transport, config, stats, report(), release
        self.is_background = is_background
        self._lock = threading.Lock()  # the engine loop aborts while the thread steps
        self._wake = threading.Event()
        self._pending: list[Load] = []  # handed over, READ not posted yet
        self._posting: dict[str, Load] = {}  # being posted right now (outside the lock)
        self._in_flight: dict[str, Load] = {}  # READ posted
        self._zombies: dict[str, Load] = {}  # failed or aborted, READ may still land
        self._stopping = stopping
        self._thread: threading.Thread | None = None  # background only, from start()

    def start(self) -> None:
        """Background: start the reader's thread (inline, the engine loop steps it)."""
        if self.is_background:
            self._thread = threading.Thread(target=self._run, name="kv-pull-reader", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ engine loop

    def add(self, loads: list[Load]) -> None:
        with self._lock:
            self._pending.extend(loads)
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """The request left WAITING_FOR_REMOTE_KV: True if a READ into its blocks may still
        be in flight (the reader reports it `settled` once it is not)."""
        with self._lock:
            unposted = [load for load in self._pending if load.request_id == request_id]
            self._pending = [load for load in self._pending if load.request_id != request_id]
            if request_id in self._zombies:
                return True
            posting = self._posting.get(request_id)
            if posting is not None:
                posting.is_aborted = True  # the poster turns it into a zombie or settles it
                return True
            load = self._in_flight.pop(request_id, None)
            if load is not None:
                self._zombies[request_id] = load  # settled by the next step()
        for dropped in unposted:
            self._base.release_remote(dropped)  # no READ will come: P may free its blocks now
        return load is not None

    def blocks_in_use(self) -> set[int]:
        with self._lock:
            loads = [*self._pending, *self._posting.values(), *self._in_flight.values(),
                     *self._zombies.values()]  # fmt: skip
        return {b for load in loads for b in load.local_ids}

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._pending or self._posting or self._in_flight or self._zombies)

    # ------------------------------------------------------------------ either thread

    def step(self) -> None:
        """Post every READ whose peer is ready, poll the ones in flight, settle zombies."""
        with self._lock:
            ready = [load for load in self._pending if load.peer.done()]
            self._pending = [load for load in self._pending if not load.peer.done()]
            self._posting.update((load.request_id, load) for load in ready)
        for load in ready:
            self._timed(load, self._start, load)
            self._posted(load)
        now = time.monotonic()
        with self._lock:
            in_flight = list(self._in_flight.items())
        for request_id, load in in_flight:
            self._timed(load, self._poll, request_id, load, now)
        self._settle_zombies()

    def _timed(self, load: Load, fn: Any, *args: Any) -> None:
        started = time.perf_counter()
        fn(*args)
        if not self.is_background:  # only time spent on the engine loop counts
            load.add_loop_time(time.perf_counter() - started)

    def _start(self, load: Load) -> None:
        error = load.peer.exception()
        if error is not None:
            self._base.fail(load, f"KV handshake with the prefill instance failed: {error}")
            return
        started = time.monotonic()
        if load.read_by_s is not None and started > load.read_by_s:
            # Reading now could copy blocks P already reused for another request.
            self._base.fail(load, "prefill instance's lease on the KV expired before the read")
            return
        notif = encode_message("read_done", request_id=load.remote_request_id)
        try:
            self._base.faults.check_transfer()
            load.handle = self._base.transport.post(
                Op.READ, load.peer.result(), load.local_ids, load.remote_ids, notif
            )
        except TransportError as exc:
            self._base.fail(load, f"KV read failed to start: {exc}")
            return
        load.posted_s = time.monotonic()
        self._base.stats["post_s_total"] += load.posted_s - started
        load.stages["handoff_setup_s"] = load.posted_s - load.allocated_s

    def _posted(self, load: Load) -> None:
        """After _start, whatever it did: file the load where its READ's state says."""
        request_id = load.request_id
        with self._lock:
            del self._posting[request_id]
            if load.handle is not None:
                (self._zombies if load.is_aborted else self._in_flight)[request_id] = load
        if load.is_aborted and load.handle is None:  # nothing was posted: free the blocks
            self._base.report(settled=request_id)

    def _poll(self, request_id: str, load: Load, now: float) -> None:
        assert load.handle is not None and load.posted_s is not None
        transport = self._base.transport
        state = transport.poll(load.handle)
        if state is TransferState.PROC:
            timeout_s = self._base.kv_config.transfer_timeout_s
            if now - load.posted_s > timeout_s and self._to_zombie(request_id, load):
                reason = f"KV read timed out after {timeout_s}s"
                self._base.fail(load, reason, is_read_in_flight=True)
            return
        with self._lock:
            if self._in_flight.pop(request_id, None) is None:
                return  # aborted meanwhile: the zombie settle releases it
        if state is TransferState.ERR:
            transport.release(load.handle)
            self._base.fail(load, "KV read failed (peer gone or transport error)")
            return
        self._base.load_done(load, now)  # reads the handle's descriptor count: release after
        transport.release(load.handle)

    def _to_zombie(self, request_id: str, load: Load) -> bool:
        with self._lock:
            if self._in_flight.pop(request_id, None) is None:
                return False
            self._zombies[request_id] = load  # its blocks stay held until it settles
            return True

    def _settle_zombies(self) -> None:
        with self._lock:
            zombies = list(self._zombies.items())
        for request_id, load in zombies:
            if load.handle is not None and self._base.transport.poll(load.handle) is (
                TransferState.PROC
            ):
                continue
            with self._lock:
                del self._zombies[request_id]
            if load.handle is not None:
                self._base.transport.release(load.handle)
            self._base.report(settled=request_id)  # frees the drained blocks
            self._base.release_remote(load)

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.step()
            except TransportError:  # closing underneath us, or a transport bug: keep serving
                log.exception("pull reader step failed")
            with self._lock:
                is_busy = bool(self._in_flight or self._zombies)
                is_waiting = bool(self._pending)
            if is_busy:
                self._stopping.wait(_BUSY_POLL_S)
            else:  # a handshake to finish, or nothing at all: sleep until handed a load
                self._wake.wait(_BUSY_POLL_S * 4 if is_waiting else _IDLE_WAIT_S)
                self._wake.clear()

    def close(self) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
