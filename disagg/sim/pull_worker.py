"""Simulated pull worker: vLLM's pull (`inline`: setup on the engine loop) or ours (setup on
the decode instance's reader thread, the real default).

Prefill side: a sent prefill's blocks stay leased until D's `read_done` arrives.
Decode side: on `start_load`, for each receive, build descriptors and post the READ — inline,
on the engine loop (the setup time is loop time: it stalls every running decode), otherwise on
the reader thread (the loop goes on) — then the bytes cross the fabric; the scheduler sees the
load finished at its next step boundary. Where the transport copies inside post (profile
`copy_in_post`), the copy is the poster's time too: loop time when inline.
"""

from __future__ import annotations

from disagg.engine.kv_connector import KVConnectorMeta, KVReceive, source_blocks
from disagg.sim.fabric import Fabric
from disagg.sim.kv_worker import SimKVWorker

__all__ = ["SimPullWorker"]


class SimPullWorker(SimKVWorker):
    def __init__(self, engine_id: str, role: str, fabric: Fabric, *, inline: bool) -> None:
        super().__init__(engine_id, role, fabric)
        self.inline = inline
        self._leases: dict[str, tuple[int, ...]] = {}  # prefill side: request id -> blocks
        self._loads: set[str] = set()  # decode side: READs posted, not yet landed

    def _start_load(self, meta: KVConnectorMeta) -> None:
        for send in meta.sends:
            self._leases[send.request_id] = send.block_ids
        for receive in meta.receives:
            self._read(receive)
        for request_id in meta.aborts:
            self.report_settled(request_id)

    def _read(self, receive: KVReceive) -> None:
        """Descriptors, then the post (on the loop when inline); the READ runs on the fabric."""
        params = receive.params
        local = list(receive.block_ids)
        # The blocks before first_block were reused from D's cache.
        remote = source_blocks(params.remote_block_ids or [], receive.first_block, len(local))
        assert params.remote_engine_id is not None and len(remote) == len(local)
        cost = self.fabric.cost
        num_descriptors = cost.num_descriptors(local, remote)
        setup_s = cost.setup_s(num_descriptors)
        post_s = self.now_s + (self.loop_busy_s if self.inline else 0.0) + setup_s
        done_s = self.fabric.transfer(params.remote_engine_id, self.engine_id, len(local), post_s)
        if cost.hardware.copy_in_post:  # the READ returns only once the bytes have moved
            setup_s += done_s - post_s
            post_s = done_s
        if self.inline:
            self.loop_busy_s += setup_s
        stages = {
            "handoff_setup_s": setup_s,
            "transfer_s": done_s - post_s,
            "loop_blocked_s": setup_s if self.inline else 0.0,
            "num_descriptors": num_descriptors,
            "num_bytes": cost.kv_bytes(len(local), self.fabric.block_size),
        }
        self._loads.add(receive.request_id)
        prefill = self.fabric.workers[params.remote_engine_id]
        assert isinstance(prefill, SimPullWorker), f"{params.remote_engine_id} does not pull"
        remote_id = params.remote_request_id or receive.request_id
        self.fabric.loop.at(done_s, lambda: self._landed(receive.request_id, stages))
        self.fabric.send_at(done_s, lambda: prefill.on_read_done(remote_id))

    def _landed(self, request_id: str, stages: dict[str, float]) -> None:
        self._loads.discard(request_id)
        self.report_received(request_id, stages)

    def on_read_done(self, request_id: str) -> None:
        """Prefill side: D has the bytes; the lease ends and the blocks may be freed."""
        if self._leases.pop(request_id, None) is not None:
            self.report_sent(request_id)

    def has_pending(self) -> bool:
        return bool(self._leases or self._loads)
