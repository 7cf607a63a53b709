"""Pull (late binding), as vLLM's default NIXL connector does it, in two halves.

`PullScheduler` (pure): a finished prefill keeps its blocks (WAITING_FOR_KV_SEND) and returns
their ids and our address; a decode request's reserved blocks become a receive for the worker.
`PullWorker` (transport, threads, side channel):
- prefill side: holds each sent prefill's blocks under a lease and frees them on the decode
  side's `read_done` (it rides on the READ), on a `/kv/release` (from D: no READ will come, or
  it ended; from the router: it never handed our answer to a decode instance), or when the
  lease expires. An abort does not end the lease: NIXL reads are one-sided, so a READ may be
  under way whatever P decides. A release that arrives before its lease is kept for a lease's
  length and ends the lease as it is made.
- decode side (pull_reader.py): handshake with P in the background on first contact, then
  build descriptors, post the READ and poll it — with `--pull-setup inline` on the engine loop
  (vLLM's pull: the tax the published comparison measures), with `background` (the default) on
  the reader's own thread, so the router still binds D late but D's decodes never wait.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from disagg.engine.kv_connector import (
    KVConnectorMeta,
    KVConnectorScheduler,
    KVReceive,
    KVSend,
    source_blocks,
)
from disagg.engine.outputs import KVConnectorOutput
from disagg.engine.request import Request
from disagg.kv.common import (
    ConnectorBase,
    HandshakeError,
    KVIdentity,
    SideChannelError,
    SideHandler,
    post_json,
)
from disagg.kv.pull_reader import Load, PullReader
from disagg.protocol import KV_RELEASE_PATH, KVTransferParams

__all__ = ["PullScheduler", "PullWorker"]

log = logging.getLogger(__name__)

_LEASE_MARGIN_S = 1.0  # covers the router hop between P's answer and our arrival


# ================================================================== scheduler half (pure)


class PullScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, identity: KVIdentity, lease_s: float) -> None:
        super().__init__(block_size)
        self.identity = identity  # where decode instances find us (port known once we listen)
        self.lease_s = lease_s

    def finished_params(self, request: Request, blocks: list[int], first: int) -> KVTransferParams:
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.identity.engine_id,
            remote_host=self.identity.host,
            remote_port=self.identity.port,
            remote_block_ids=blocks,
            remote_request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            first_token_id=first,
            lease_s=self.lease_s,
            connector="pull",
        )


# ================================================================== worker half


@dataclass(slots=True, eq=False)
class _Lease:  # prefill side
    block_ids: tuple[int, ...]
    deadline: float  # monotonic; the blocks are freed then even if no read_done came
    is_aborted: bool = False  # freed as `settled`, not `sent`: the request is gone


class PullWorker(ConnectorBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        is_background = self.kv_config.pull_setup == "background"
        self.reader = PullReader(self, is_background=is_background, stopping=self._stopping)
        # Prefill side: request id -> lease. D may READ the blocks at any time until the lease
        # ends (read_done or expiry), even after we aborted the request: one-sided reads.
        self._leases: dict[str, _Lease] = {}
        # Prefill side: request id -> monotonic deadline of a release that found no lease. The
        # router releases when its client leaves mid P leg, maybe while our loop is still in
        # the step that finishes the prefill: the lease made then must end at once.
        self._early_releases: dict[str, float] = {}

    def start(self) -> None:
        super().start()
        self.reader.start()

    # ------------------------------------------------------------------ engine loop

    def start_load(self, meta: KVConnectorMeta) -> None:
        """Inline, the reader builds descriptors and posts READs right here, on the loop; in
        the background this is a queue put and the reader's thread does the rest."""
        started = time.perf_counter()
        for send in meta.sends:
            self._lease(send)
        loads = [self._load_for(receive) for receive in meta.receives]
        self.reader.add(loads)
        for load in loads:  # the loop's share of handing them over
            load.add_loop_time((time.perf_counter() - started) / len(loads))
        for request_id in meta.aborts:
            self._abort(request_id)
        for params in meta.dropped:
            self._release_dropped(params)
        if not self.reader.is_background:
            self.reader.step()

    def get_finished(self) -> KVConnectorOutput:
        if not self.reader.is_background:
            self.reader.step()  # inline: polling the READs is the loop's work too
        self._expire_leases(time.monotonic())
        return self.take_reports()

    def _lease(self, send: KVSend) -> None:
        deadline = time.monotonic() + self.kv_config.lease_s
        with self._lock:
            self._leases[send.request_id] = _Lease(send.block_ids, deadline)
            is_released = self._early_releases.pop(send.request_id, None) is not None
        if is_released:
            self._end_lease(send.request_id)

    def _load_for(self, receive: KVReceive) -> Load:
        params = receive.params
        # P's blocks line up with the whole prompt; ours start at `first_block` (the ones
        # before it we reused from our own cache, and read nothing into).
        num_local = len(receive.block_ids)
        remote_ids = source_blocks(params.remote_block_ids or [], receive.first_block, num_local)
        problem = _check_params(params, len(remote_ids), num_local)
        peer: Future[str] = Future()
        if problem is None:
            assert params.remote_engine_id and params.remote_host and params.remote_port
            peer = self.ensure_peer(params.remote_engine_id, params.remote_host, params.remote_port)
            prefill_url: str | None = self.side_url(params.remote_host, params.remote_port)
        else:
            peer.set_exception(ValueError(problem))
            prefill_url = None
        return Load(
            request_id=receive.request_id,
            local_ids=list(receive.block_ids),
            remote_ids=remote_ids,
            remote_request_id=params.remote_request_id or receive.request_id,
            prefill_url=prefill_url,
            peer=peer,
            allocated_s=time.monotonic(),
            read_by_s=_read_deadline(receive.arrival_s, params.lease_s),
        )

    def _abort(self, request_id: str) -> None:
        """Report `settled` once no transfer can touch the request's blocks."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:  # prefill side: D may be reading right now
                lease.is_aborted = True
                return
        if not self.reader.abort(request_id):
            self.report(settled=request_id)

    # ------------------------------------------------------------------ reader callbacks

    def fail(self, load: Load, reason: str, *, is_read_in_flight: bool = False) -> None:
        """A load failed (any thread): fail the request by policy; if no READ of P's blocks
        is in flight, let P free them now."""
        self.report(failed=(load.request_id, self.failure(reason)), breakdown=load.breakdown_of())
        if not is_read_in_flight:
            self.release_remote(load)

    def load_done(self, load: Load, now: float) -> None:
        """A READ landed (any thread): record it, and let the scheduler start decoding."""
        assert load.posted_s is not None and load.handle is not None
        num_descriptors = self.transport.num_descriptors(load.handle)
        load.stages.update(
            transfer_s=now - load.posted_s,
            num_descriptors=num_descriptors,
            num_bytes=len(load.local_ids) * self.block_nbytes,
        )
        self.count_transfer(len(load.local_ids), num_descriptors, now - load.posted_s)
        self.report(received=load.request_id, breakdown=load.breakdown_of())

    def release_remote(self, load: Load) -> None:
        """No READ of P's blocks for this load is in flight or will be: tell P over its side
        channel (no transport peer needed, so it works when the handshake failed), so it
        frees them now rather than at the end of its lease."""
        if load.prefill_url is None:
            return
        url, body = f"{load.prefill_url}/kv/release", {"request_id": load.remote_request_id}
        self.calls.submit(self._post_quietly, url, body)

    def _release_dropped(self, params: KVTransferParams) -> None:
        """Decode side: the request ended before its READ was set up (aborted while it waited
        for blocks or a seat), so P may free its lease now rather than when it expires."""
        if params.remote_host and params.remote_port and params.remote_request_id:
            url = self.side_url(params.remote_host, params.remote_port) + KV_RELEASE_PATH
            self.calls.submit(self._post_quietly, url, {"request_id": params.remote_request_id})

    def _post_quietly(self, url: str, body: dict[str, Any]) -> None:
        try:
            post_json(url, body, timeout_s=5.0, secret=self.secret, context=self.side_tls)
        except HandshakeError as exc:  # P gone: its lease covers what this would have freed
            log.info("release at %s not delivered: %s", url, exc)

    # ------------------------------------------------------------------ leases

    def _expire_leases(self, now: float) -> None:
        with self._lock:
            expired = [rid for rid, lease in self._leases.items() if lease.deadline < now]
            for request_id in [r for r, s in self._early_releases.items() if s < now]:
                del self._early_releases[request_id]  # its lease never came: nothing to end
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

    # ------------------------------------------------------------------ state

    def blocks_in_use(self) -> set[int]:
        with self._lock:
            leased = {b for lease in self._leases.values() for b in lease.block_ids}
        return leased | self.reader.blocks_in_use()

    def needs_loop_poll(self) -> bool:
        return not self.reader.is_background and self.reader.has_work()

    def has_pending(self) -> bool:
        return bool(self._leases) or self.reader.has_work()

    def close(self) -> None:
        super().close()  # sets _stopping: the reader's thread ends too
        self.reader.close()

    # ------------------------------------------------------------------ side channel, listener

    def side_channel(self) -> dict[str, SideHandler]:
        return {**super().side_channel(), KV_RELEASE_PATH: self._handle_release}

    async def _handle_release(self, body: dict[str, Any]) -> dict[str, Any]:
        """Prefill side: a decode instance will not read (or has stopped reading) a lease."""
        try:
            request_id = str(body["request_id"])
        except (KeyError, TypeError) as exc:
            raise SideChannelError(400, f"bad release: {exc}") from exc
        with self._lock:
            if request_id not in self._leases:  # not made yet, or over: kept for a lease's length
                self._early_releases[request_id] = time.monotonic() + self.kv_config.lease_s
        self._end_lease(request_id)
        return {"request_id": request_id}

    def on_message(self, peer: str, message: dict[str, Any]) -> None:
        if message.get("kind") == "read_done":
            self._end_lease(str(message.get("request_id")))


def _read_deadline(arrival_s: float, lease_s: float | None) -> float | None:
    return None if lease_s is None else arrival_s + lease_s - _LEASE_MARGIN_S


def _check_params(params: Any, num_remote: int, num_needed: int) -> str | None:
    if not (params.remote_engine_id and params.remote_host and params.remote_port):
        return "kv_transfer_params lack remote_engine_id/remote_host/remote_port"
    if num_remote < num_needed:
        return f"kv_transfer_params carry {num_remote} remote blocks, the prompt needs {num_needed}"
    return None
