"""Simulated push worker (vLLM's push connector, SGLang, Mooncake).

Decode side: a receive registers its blocks with P over the side channel (a call thread: no
loop time); completion arrives as P's notification.
Prefill side: the writer thread prepares descriptors as soon as a registration arrives (while
the prefill runs) and posts the WRITE when both the registration and the finished prefill are
known; it frees P's blocks once the write has landed. Neither engine loop waits.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.kv_connector import KVConnectorMeta, KVReceive, KVSend, source_blocks
from disagg.sim.fabric import Fabric
from disagg.sim.kv_worker import SimKVWorker

__all__ = ["SimPushWorker"]


@dataclass(slots=True)
class _Registration:  # prefill side: where D wants the KV
    decode_engine_id: str
    request_id: str  # D's request id
    block_ids: list[int]
    prepared_s: float  # descriptors ready (the writer starts preparing on arrival)
    first_block: int = 0  # the prompt block block_ids[0] stands for (D reused those before)


@dataclass(slots=True)
class _Prefilled:  # prefill side: a finished prefill awaiting its registration
    send: KVSend
    done_s: float


class SimPushWorker(SimKVWorker):
    def __init__(self, engine_id: str, role: str, fabric: Fabric) -> None:
        super().__init__(engine_id, role, fabric)
        self._registrations: dict[str, _Registration] = {}  # transfer id -> registration
        self._prefilled: dict[str, _Prefilled] = {}  # transfer id -> finished prefill
        self._writes: set[str] = set()  # request ids whose WRITE is in flight (P side)
        self._reservations: set[str] = set()  # decode side: request ids awaiting the write

    def _start_load(self, meta: KVConnectorMeta) -> None:
        for receive in meta.receives:
            self._register(receive)
        for send in meta.sends:
            assert send.params.transfer_id is not None
            self._prefilled[send.params.transfer_id] = _Prefilled(send, self.now_s)
            self._try_write(send.params.transfer_id)
        for request_id in meta.aborts:
            self.report_settled(request_id)

    # ------------------------------------------------------------------ decode side

    def _register(self, receive: KVReceive) -> None:
        params = receive.params
        assert params.transfer_id is not None and params.remote_engine_id is not None
        self._reservations.add(receive.request_id)
        prefill = self.fabric.workers[params.remote_engine_id]
        assert isinstance(prefill, SimPushWorker)
        tid, block_ids, first = params.transfer_id, list(receive.block_ids), receive.first_block
        self.fabric.post_http(
            lambda: prefill.on_register(tid, self.engine_id, receive.request_id, block_ids, first)
        )

    def on_write_done(self, request_id: str, first_token: int, stages: dict[str, float]) -> None:
        self._reservations.discard(request_id)
        self.report_received(request_id, stages, first_token)

    # ------------------------------------------------------------------ prefill side

    def on_register(
        self, tid: str, decode_id: str, request_id: str, block_ids: list[int], first_block: int
    ) -> None:
        """The writer prepares descriptors from now on, while the prefill runs (D's side of
        each run is known; P's is not yet, so the count is D's). Handling the call is P's
        event-loop work, which takes turns with P's engine loop in one interpreter."""
        cost = self.fabric.cost
        if cost.hardware.host is not None:
            self.charge_loop_s(cost.hardware.host.loop_request_cpu_s)
        num_descriptors = cost.num_descriptors(block_ids, block_ids)
        prepared_s = self.now_s + num_descriptors * cost.hardware.setup_per_descriptor_s
        self._registrations[tid] = _Registration(
            decode_id, request_id, block_ids, prepared_s, first_block
        )
        self._try_write(tid)

    def _try_write(self, tid: str) -> None:
        """Post the WRITE once both halves are known (in either order), off the engine loop."""
        if tid not in self._registrations or tid not in self._prefilled:
            return
        registration, prefilled = self._registrations.pop(tid), self._prefilled.pop(tid)
        cost, send = self.fabric.cost, prefilled.send
        remote = registration.block_ids  # D reused the blocks before first_block
        local = source_blocks(send.block_ids, registration.first_block, len(remote))
        num_descriptors = cost.num_descriptors(local, remote)
        ready_s = max(self.now_s, registration.prepared_s)
        post_s = ready_s + cost.hardware.setup_fixed_s
        done_s = self.fabric.transfer(
            self.engine_id, registration.decode_engine_id, len(local), post_s
        )
        stages = {
            "handoff_setup_s": post_s - self.now_s,  # on the path: what prefill did not hide
            "transfer_s": done_s - post_s,
            "loop_blocked_s": 0.0,
            "num_descriptors": num_descriptors,
            "num_bytes": cost.kv_bytes(len(local), self.fabric.block_size),
        }
        self._writes.add(send.request_id)
        decode = self.fabric.workers[registration.decode_engine_id]
        assert isinstance(decode, SimPushWorker)
        first, decode_request = send.first_token_id, registration.request_id
        self.fabric.loop.at(done_s, lambda: self._written(send.request_id))
        self.fabric.send_at(done_s, lambda: decode.on_write_done(decode_request, first, stages))

    def _written(self, request_id: str) -> None:
        self._writes.discard(request_id)
        self.report_sent(request_id)

    def has_pending(self) -> bool:
        return bool(self._registrations or self._prefilled or self._writes or self._reservations)
