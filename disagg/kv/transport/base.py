"""The transport contract: move whole KV blocks between two processes' registered buffers.

A transport knows bytes and block indices only (no torch, no requests). The KV tensor is one
contiguous buffer of `num_blocks` blocks of `block_nbytes` each (a block of all layers is
contiguous), so one descriptor per block moves a request's KV.

Lifecycle:  register(buffer) once -> metadata() to peers -> add_peer(their metadata)
            -> post(READ|WRITE, peer, local_ids, remote_ids, notif) -> poll(handle) until DONE|ERR
            -> release(handle);  the target sees `notif` in get_notifs() once the bytes landed.

Also the checks every implementation shares (open, registered once, known peer and handle,
transfer arguments), so each refuses a bad call with the same message.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Op", "PeerInfo", "Transport", "TransferState", "TransportError"]

_K = TypeVar("_K")
_V = TypeVar("_V")


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
    _is_closed: bool = False  # set by close(): every later call raises

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

    # ---- checks every implementation shares (called with its lock held) -------------------

    def _check_open(self) -> None:
        if self._is_closed:
            raise TransportError(f"{self.name}: transport is closed")

    def _check_register(self, region: object, num_blocks: int, block_nbytes: int) -> None:
        """register() is called once, on an open transport, with a non-empty region."""
        self._check_open()
        if region is not None:
            raise TransportError(f"{self.name}: register() called twice")
        if num_blocks <= 0 or block_nbytes <= 0:
            raise TransportError(f"bad region: {num_blocks} blocks x {block_nbytes} bytes")

    def _known(self, table: Mapping[_K, _V], key: _K, what: str) -> _V:
        """table[key] on an open transport, else TransportError naming the unknown `what`."""
        self._check_open()
        if key not in table:
            raise TransportError(f"{self.name}: unknown {what} {key!r}")
        return table[key]

    def _check_peer_blocks(self, info: PeerInfo, block_nbytes: int) -> None:
        """A peer's blocks must be as large as ours."""
        if info.block_nbytes != block_nbytes:
            raise TransportError(
                f"peer {info.name!r} has {info.block_nbytes}-byte blocks, we {block_nbytes}"
            )

    def _check_transfer(
        self, local_ids: Sequence[int], remote_ids: Sequence[int], num_local: int, num_remote: int
    ) -> None:
        """Both id lists non-empty, equally long and in range of their side's blocks."""
        if len(local_ids) != len(remote_ids):
            raise TransportError(
                f"length mismatch: {len(local_ids)} local ids vs {len(remote_ids)} remote ids"
            )
        if len(local_ids) == 0:
            raise TransportError("a transfer needs at least one block (use send_notif for none)")
        _check_range(local_ids, num_local, "local")
        _check_range(remote_ids, num_remote, "remote")


def _check_range(ids: Sequence[int], num_blocks: int, side: str) -> None:
    # min/max over the list: ~10 ns per id, negligible next to the transfer itself
    low, high = min(ids), max(ids)
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise TransportError(f"{side} block id {bad} out of range [0, {num_blocks})")
