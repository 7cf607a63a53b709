"""Pull (late binding), as vLLM's default NIXL connector does it.

Prefill side: keep a finished request's blocks under a lease and return their ids and our
address; free them on the decode side's `read_done` notification (it rides on the READ), on its
`/kv/release` (no READ will come, or it ended), or when the lease expires. An abort does not end
the lease: NIXL reads are one-sided, so a READ may be under way whatever P decides.
Decode side: once blocks are allocated, handshake with P in the background on first contact,
then build descriptors and post the READ **inline on the engine loop** in `start_load()` (the
latency tax this mode is measured for), and poll it every step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from disagg.engine.outputs import KVConnectorOutput
from disagg.engine.request import Request
from disagg.kv.common import ConnectorBase, HandshakeError, post_json
from disagg.kv.handshake import encode_message
from disagg.kv.transport import Op, TransferState, TransportError

__all__ = ["PullConnector"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Load:
    request: Request
    local_ids: list[int]
    remote_ids: list[int]
    remote_request_id: str
    prefill_url: str | None  # P's side channel (None when the params lacked it)
    peer: Future[str]
    allocated_s: float
    read_by_s: float | None  # after this P's lease may have freed the blocks: do not read
    handle: int | None = None
    posted_s: float | None = None
    num_descriptors: int = 0


@dataclass(slots=True, eq=False)
class _Lease:  # prefill side
    block_ids: list[int]
    deadline: float  # monotonic; the blocks are freed then even if no read_done came
    is_aborted: bool = False  # freed as `settled`, not `sent`: the request is gone


class PullConnector(ConnectorBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before the base starts the listener thread, which calls has_pending().
        self._new: list[_Load] = []  # allocated this step (build_meta hands them over)
        self._pending: list[_Load] = []  # waiting for a handshake (engine loop only)
        self._in_flight: dict[str, _Load] = {}  # READ posted (engine loop only)
        self._zombies: dict[str, _Load] = {}  # gave up on, but may still land: poll to settle
        # Prefill side: request id -> lease. D may READ the blocks at any time until the lease
        # ends (read_done or expiry), even after we aborted the request: one-sided reads.
        self._leases: dict[str, _Lease] = {}
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens if request.needs_remote_kv else 0

    def on_blocks_allocated(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        assert params is not None
        num_blocks = self.num_prompt_blocks(request)
        remote_ids = params.remote_block_ids or []
        problem = _check_params(params, len(remote_ids), num_blocks)
        peer: Future[str] = Future()
        if problem is None:
            assert params.remote_engine_id and params.remote_host and params.remote_port
            peer = self.ensure_peer(params.remote_engine_id, params.remote_host, params.remote_port)
        else:
            peer.set_exception(ValueError(problem))
        self._new.append(
            _Load(
                request=request,
                local_ids=block_ids[:num_blocks],
                remote_ids=remote_ids[:num_blocks],
                remote_request_id=params.remote_request_id or request.request_id,
                prefill_url=f"http://{params.remote_host}:{params.remote_port}"
                if problem is None
                else None,
                peer=peer,
                allocated_s=time.monotonic(),
                read_by_s=_read_deadline(request.arrival_s, params.lease_s),
            )
        )

    def build_meta(self) -> object:
        meta, self._new = self._new, []
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, object] | None]:
        if not self.sends_kv(request):
            return False, None
        num_blocks = self.num_prompt_blocks(request)
        deadline = time.monotonic() + self.kv_config.lease_s
        with self._lock:
            self._leases[request.request_id] = _Lease(request.block_ids[:num_blocks], deadline)
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": request.block_ids[:num_blocks],
            "remote_request_id": request.request_id,
            "num_prompt_tokens": request.num_prompt_tokens,
            "first_token_id": request.output_token_ids[0],
            "lease_s": self.kv_config.lease_s,
            "connector": "pull",
        }

    def request_aborted(self, request: Request) -> bool:
        request_id = request.request_id
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:  # prefill side: D may be reading right now
                lease.is_aborted = True
                return True
        unposted = [load for load in [*self._new, *self._pending] if load.request is request]
        self._new = [load for load in self._new if load.request is not request]
        self._pending = [load for load in self._pending if load.request is not request]
        for load in unposted:
            self._release_remote(load)  # no READ will come: P may free its blocks now
        if request_id in self._zombies:
            return True  # timed out but not settled: the blocks wait for it
        load = self._in_flight.pop(request_id, None)
        if load is None:
            return False
        if self.transport.poll(load.handle) is TransferState.PROC:
            self._zombies[request_id] = load  # report it once settled, then the blocks go
            return True
        self.transport.release(load.handle)
        self._release_remote(load)
        return False

    # ------------------------------------------------------------------ worker side

    def start_load(self, meta: object) -> None:
        """Engine loop: post the READ of every load whose peer is ready. Deliberately inline."""
        self._pending.extend(meta or [])
        still_waiting = []
        for load in self._pending:
            if not load.peer.done():
                still_waiting.append(load)
                continue
            if load.peer.exception() is not None:
                self._fail(
                    load, f"KV handshake with the prefill instance failed: {load.peer.exception()}"
                )
                continue
            self._post(load)
        self._pending = still_waiting

    def _post(self, load: _Load) -> None:
        request_id = load.request.request_id
        notif = encode_message("read_done", request_id=load.remote_request_id)
        started = time.monotonic()
        if load.read_by_s is not None and started > load.read_by_s:
            # Reading now could copy blocks P already reused for another request.
            self._fail(load, "prefill instance's lease on the KV expired before the read")
            return
        try:
            if self.kv_config.fault == "fail_transfer":
                raise TransportError("injected transfer failure (fault=fail_transfer)")
            load.handle = self.transport.post(
                Op.READ, load.peer.result(), load.local_ids, load.remote_ids, notif
            )
        except TransportError as exc:
            self._fail(load, f"KV read failed to start: {exc}")
            return
        load.posted_s = time.monotonic()
        self.stats["post_s_total"] += load.posted_s - started
        load.request.breakdown.handoff_setup_s = load.posted_s - load.allocated_s
        self._in_flight[request_id] = load

    def _fail(self, load: _Load, reason: str, *, is_read_in_flight: bool = False) -> None:
        self.report(failed=(load.request.request_id, self.failure(reason)))
        if not is_read_in_flight:
            self._release_remote(load)

    def _release_remote(self, load: _Load) -> None:
        """No READ of P's blocks for this load is in flight or will be: tell P over its side
        channel (no transport peer needed, so it works when the handshake failed), so it
        frees them now rather than at the end of its lease."""
        if load.prefill_url is None:
            return
        url, body = f"{load.prefill_url}/kv/release", {"request_id": load.remote_request_id}
        self.calls.submit(self._post_quietly, url, body)

    def _post_quietly(self, url: str, body: dict[str, Any]) -> None:
        try:
            post_json(url, body, timeout_s=5.0, secret=self.secret)
        except HandshakeError as exc:  # P gone: its lease covers what this would have freed
            log.info("release at %s not delivered: %s", url, exc)

    def get_finished(self) -> KVConnectorOutput:
        now = time.monotonic()
        for request_id, load in list(self._in_flight.items()):
            self._poll_load(request_id, load, now)
        self._settle_zombies()
        self._expire_leases(now)
        return self.take_reports()

    def _poll_load(self, request_id: str, load: _Load, now: float) -> None:
        assert load.handle is not None and load.posted_s is not None
        state = self.transport.poll(load.handle)
        if state is TransferState.PROC:
            if now - load.posted_s > self.kv_config.transfer_timeout_s:
                del self._in_flight[request_id]
                self._zombies[request_id] = load  # blocks stay held until it settles
                timeout = self.kv_config.transfer_timeout_s
                self._fail(load, f"KV read timed out after {timeout}s", is_read_in_flight=True)
            return
        del self._in_flight[request_id]
        if state is TransferState.ERR:
            self.transport.release(load.handle)
            self._fail(load, "KV read failed (peer gone or transport error)")
            return
        breakdown = load.request.breakdown
        breakdown.transfer_s = now - load.posted_s
        breakdown.num_descriptors = self.transport.num_descriptors(load.handle)
        breakdown.num_bytes = len(load.local_ids) * self.block_nbytes
        self.count_transfer(len(load.local_ids), breakdown.num_descriptors, breakdown.transfer_s)
        self.transport.release(load.handle)
        self.report(received=request_id)

    def _settle_zombies(self) -> None:
        for request_id, load in list(self._zombies.items()):
            if self.transport.poll(load.handle) is not TransferState.PROC:
                del self._zombies[request_id]
                self.transport.release(load.handle)
                self.report(settled=request_id)  # frees the drained blocks
                self._release_remote(load)

    def _expire_leases(self, now: float) -> None:
        with self._lock:
            expired = [rid for rid, lease in self._leases.items() if lease.deadline < now]
        for request_id in expired:
            self.stats["expired_leases"] += 1
            self._end_lease(request_id)

    def _end_lease(self, request_id: str) -> None:
        """No READ of these blocks can come any more: free them (any thread)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is None:
            return
        if lease.is_aborted:
            self.report(settled=request_id)
        else:
            self.report(sent=request_id)

    def blocks_in_use(self) -> set[int]:
        with self._lock:
            leased = {b for lease in self._leases.values() for b in lease.block_ids}
        loads = [*self._new, *self._pending, *self._in_flight.values(), *self._zombies.values()]
        return leased | {b for load in loads for b in load.local_ids}

    def needs_loop_poll(self) -> bool:
        return bool(self._pending or self._in_flight or self._zombies)

    def has_pending(self) -> bool:
        return bool(self._pending or self._in_flight or self._zombies or self._leases)

    # ------------------------------------------------------------------ listener thread

    def http_routes(self) -> list[web.RouteDef]:
        return [*super().http_routes(), web.post("/kv/release", self._handle_release)]

    async def _handle_release(self, request: web.Request) -> web.Response:
        """Prefill side: a decode instance will not read (or has stopped reading) a lease."""
        try:
            request_id = str((await request.json())["request_id"])
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": {"message": f"bad release: {exc}"}}, status=400)
        self._end_lease(request_id)
        return web.json_response({"request_id": request_id})

    def on_message(self, peer: str, message: dict[str, Any]) -> None:
        if message.get("kind") != "read_done":
            return
        self._end_lease(str(message.get("request_id")))


_LEASE_MARGIN_S = 1.0  # covers the router hop between P's answer and our arrival


def _read_deadline(arrival_s: float, lease_s: float | None) -> float | None:
    return None if lease_s is None else arrival_s + lease_s - _LEASE_MARGIN_S


def _check_params(params: Any, num_remote: int, num_needed: int) -> str | None:
    if not (params.remote_engine_id and params.remote_host and params.remote_port):
        return "kv_transfer_params lack remote_engine_id/remote_host/remote_port"
    if num_remote < num_needed:
        return f"kv_transfer_params carry {num_remote} remote blocks, the prompt needs {num_needed}"
    return None
