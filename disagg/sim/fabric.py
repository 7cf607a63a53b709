"""The simulated network between instances: NIC queues, transfer times and message delivery.

Each instance has one egress and one ingress queue (its NICs, all ranks together); a transfer
starts when both ends are free, holds them for bytes / bandwidth and lands one latency later.
Messages (registrations, notifications) are delivered after a fixed delay. Pure bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg.engine.kv_connector import KVConnectorWorker
from disagg.sim.cost import CostModel
from disagg.sim.events import EventLoop

__all__ = ["Fabric"]


class Fabric:
    def __init__(self, loop: EventLoop, cost: CostModel, block_size: int) -> None:
        self.loop = loop
        self.cost = cost
        self.block_size = block_size
        # engine id -> its connector worker; typed by the contract, as the fabric only
        # addresses them (a worker checks its peer's kind where it calls it)
        self.workers: dict[str, KVConnectorWorker] = {}
        self._egress_free_s: dict[str, float] = {}
        self._ingress_free_s: dict[str, float] = {}
        self.num_transfers = 0
        self.num_bytes = 0

    def add(self, engine_id: str, worker: KVConnectorWorker) -> None:
        self.workers[engine_id] = worker

    def transfer(self, src: str, dst: str, num_blocks: int, post_s: float) -> float:
        """Queue `num_blocks` of KV from `src` to `dst`, posted at `post_s`; returns the time
        the bytes have landed at `dst`."""
        num_bytes = self.cost.kv_bytes(num_blocks, self.block_size)
        start_s = max(post_s, self._egress_free_s.get(src, 0.0), self._ingress_free_s.get(dst, 0.0))
        end_s = start_s + self.cost.transfer_s(num_bytes)
        self._egress_free_s[src] = self._ingress_free_s[dst] = end_s
        self.num_transfers += 1
        self.num_bytes += num_bytes
        return end_s + self.cost.hardware.latency_s

    def send_at(self, time_s: float, deliver: Callable[[], None]) -> None:
        """A notification leaving at `time_s` (RDMA-level latency)."""
        self.loop.at(time_s + self.cost.hardware.latency_s, deliver)

    def post_http(self, deliver: Callable[[], None]) -> None:
        """A side-channel HTTP call (registration) from now: one hop."""
        self.loop.after(self.cost.hardware.http_hop_s, deliver)
