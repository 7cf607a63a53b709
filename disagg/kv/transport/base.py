"""The transport contract: move whole KV blocks between two processes' registered buffers.

A transport knows bytes and block indices only (no torch, no requests). The KV tensor is one
contiguous buffer of `num_blocks` blocks of `block_nbytes` each (a block of all layers is
contiguous), so one descriptor per block moves a request's KV.

Lifecycle:  register(buffer) once -> metadata() to peers -> add_peer(their metadata)
            -> post(READ|WRITE, peer, local_ids, remote_ids, notif) -> poll(handle) until DONE|ERR
            -> release(handle);  the target sees `notif` in get_notifs() once the bytes landed.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

__all__ = ["Op", "PeerInfo", "Transport", "TransferState", "TransportError"]


class Op(enum.Enum):
    READ = "READ"  # remote blocks -> local blocks (pull: D reads from P)
    WRITE = "WRITE"  # local blocks -> remote blocks (push: P writes into D)


class TransferState(enum.Enum):
    PROC = "PROC"  # in flight
    DONE = "DONE"  # bytes landed on both sides; notif delivered (or queued) at the target
    ERR = "ERR"  # failed; the blocks touched may hold partial data


class TransportError(RuntimeError):
    """A transport call failed (peer unreachable, bad metadata, buffer not registered)."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    name: str  # the peer's agent name (unique per process)
    num_blocks: int
    block_nbytes: int


class Transport(abc.ABC):
    """One per process. Thread-safety: post/poll/release/get_notifs may be called from any one
    thread at a time per handle; implementations guard their shared state with a lock."""

    name: str  # this agent's name, unique per process (e.g. "<engine_id>")

    @abc.abstractmethod
    def register(self, base_addr: int, num_blocks: int, block_nbytes: int) -> None:
        """Register the KV buffer [base_addr, base_addr + num_blocks * block_nbytes) once,
        before metadata() is called. The caller keeps the memory alive until close()."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to add_peer() to reach this transport."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> PeerInfo:
        """Connect to a peer from its metadata (idempotent: a known peer is refreshed, so a
        restarted peer with the same name is re-connected). Raises TransportError."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer (it died or restarted); handles to it fail."""

    @abc.abstractmethod
    def post(
        self, op: Op, peer: str, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> int:
        """Start moving len(local_ids) blocks; non-blocking. Returns a handle.
        `notif` is delivered to the peer after the bytes land. Raises TransportError on bad
        arguments (unknown peer, id out of range, length mismatch)."""

    @abc.abstractmethod
    def poll(self, handle: int) -> TransferState:
        """Non-blocking state of a posted transfer."""

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Free a handle. Must not be called while poll() says PROC (the blocks may still be
        touched); callers that give up on a transfer keep the handle until it settles."""

    @abc.abstractmethod
    def send_notif(self, peer: str, notif: bytes) -> None:
        """Send a small message to a peer without moving blocks (e.g. push registration)."""

    @abc.abstractmethod
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Drain notifications received since the last call: (peer name, message)."""

    @abc.abstractmethod
    def num_descriptors(self, handle: int) -> int:
        """Descriptors the transfer used (after any merging the library does), for metrics."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource; later calls raise TransportError."""

    @property
    def num_refused_connections(self) -> int:
        """Connections from peers turned away at this transport's cap (0: no cap of ours)."""
        return 0
