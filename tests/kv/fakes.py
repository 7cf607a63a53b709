"""Fakes for the connectors' state machines: a transport whose transfers finish when a test
says so, the connector surface (`base`) that PullReader and PushWriter report through, and a
real connector worker over the local transport (`make_worker`)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from disagg.config import CacheConfig, EngineConfig, KVTransferConfig
from disagg.engine.outputs import KVConnectorOutput, KVFailure
from disagg.kv.faults import KVFaults
from disagg.kv.transport import Op, TransferState, TransportError


@dataclass
class Posted:
    op: Op
    peer: str
    local_ids: list[int]
    remote_ids: list[int]
    notif: bytes
    state: TransferState = TransferState.PROC
    is_released: bool = False


class FakeTransport:
    """post() records; a transfer stays PROC until finish(handle, state)."""

    def __init__(self) -> None:
        self.posted: dict[int, Posted] = {}
        self.notifs: list[tuple[str, bytes]] = []
        self.fail_posts = False
        self._ids: Iterator[int] = itertools.count(1)
        self._lock = threading.Lock()

    def post(self, op: Op, peer: str, local_ids: list[int], remote_ids: list[int],
             notif: bytes) -> int:  # fmt: skip
        if self.fail_posts:
            raise TransportError("fake: post refused")
        with self._lock:
            handle = next(self._ids)
            self.posted[handle] = Posted(op, peer, list(local_ids), list(remote_ids), notif)
        return handle

    def finish(self, handle: int, state: TransferState = TransferState.DONE) -> None:
        self.posted[handle].state = state

    def poll(self, handle: int) -> TransferState:
        return self.posted[handle].state

    def release(self, handle: int) -> None:
        posted = self.posted[handle]
        assert posted.state is not TransferState.PROC, "released while in flight"
        posted.is_released = True

    def num_descriptors(self, handle: int) -> int:
        return len(self.posted[handle].local_ids)

    def send_notif(self, peer: str, notif: bytes) -> None:
        self.notifs.append((peer, notif))


@dataclass
class FakeBase:
    """What PullReader / PushWriter use of their connector; records what they report."""

    transport: FakeTransport = field(default_factory=FakeTransport)
    kv_config: Any = field(default_factory=lambda: SimpleNamespace(
        transfer_timeout_s=5.0, lease_s=30.0))  # fmt: skip
    faults: KVFaults = field(default_factory=KVFaults)
    stats: dict[str, float] = field(default_factory=lambda: _zero_stats())
    reports: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    released: list[str] = field(default_factory=list)  # pull: /kv/release sent for these
    block_nbytes: int = 1024

    def report(self, *, sent: str | None = None, received: str | None = None,
               failed: tuple[str, KVFailure] | None = None, settled: str | None = None,
               first_token: tuple[str, int] | None = None) -> None:  # fmt: skip
        if sent:
            self.reports.finished_sending.add(sent)
        if received:
            self.reports.finished_recving.add(received)
        if failed:
            self.reports.failed[failed[0]] = failed[1]
        if settled:
            self.reports.settled.add(settled)

    def fail(self, load: Any, reason: str, *, is_read_in_flight: bool = False) -> None:
        self.report(failed=(load.request_id, KVFailure(reason)))
        if not is_read_in_flight:
            self.release_remote(load)

    def release_remote(self, load: Any) -> None:
        self.released.append(load.remote_request_id)

    def load_done(self, load: Any, now: float) -> None:
        self.report(received=load.request_id)

    def count_transfer(self, num_blocks: int, num_descriptors: int, seconds: float) -> None:
        self.stats["transfers"] += 1

    def notify_quietly(self, peer: str, message: bytes) -> None:
        self.transport.send_notif(peer, message)


def _zero_stats() -> dict[str, float]:
    names = (
        "transfers", "transfers_failed", "post_s_total", "expired_leases",
        "registrations_before_ready", "registrations_after_ready", "registrations_refused",
    )  # fmt: skip
    return dict.fromkeys(names, 0.0)


def ready_peer(name: str = "p") -> Future[str]:
    peer: Future[str] = Future()
    peer.set_result(name)
    return peer


_Worker = TypeVar("_Worker")


def make_worker(cls: type[_Worker], **kv: Any) -> tuple[_Worker, np.ndarray]:
    """A connector worker (not started) over the local transport, on an 8-block KV buffer of
    1 KiB blocks that the caller keeps alive; `kv` are KVTransferConfig fields."""
    buffer = np.zeros(8 * 1024, np.uint8)
    spec = SimpleNamespace(architecture="qwen3", num_layers=1, num_kv_heads=1, head_dim=8,
                           vocab_size=64, hidden_size=8)  # fmt: skip
    runner = SimpleNamespace(kv_base_addr=buffer.ctypes.data, num_blocks=8, block_nbytes=1024,
                             dtype_name="float32", spec=spec)  # fmt: skip
    kv_transfer = KVTransferConfig(transport="local", cluster_token="t" * 16, **kv)
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=8), kv_transfer=kv_transfer)
    return cls(config, runner), buffer  # type: ignore[call-arg]
