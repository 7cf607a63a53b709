"""In-process reference transport: a post copies blocks synchronously with memmove.

Owns the process-wide name -> transport registry and `buffer_view` (raw memory as bytes). Used
by unit tests and the simulator; it must not spawn threads or touch sockets. A peer "dies" when
its transport is closed; a new one with the same name is a restart.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import threading
import uuid
from dataclasses import dataclass

from disagg.kv.transport.base import Op, PeerInfo, TransferState, Transport, TransportError

__all__ = ["LocalTransport", "buffer_view"]

_MAGIC = b"DKVL"
_registry: dict[str, LocalTransport] = {}  # live transports of this process, by name
_registry_lock = threading.Lock()


def buffer_view(base_addr: int, nbytes: int) -> memoryview:
    """A writable byte view over raw memory the caller keeps alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(base_addr)).cast("B")


@dataclass(frozen=True, slots=True)
class _Region:
    base_addr: int
    num_blocks: int
    block_nbytes: int

    def addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_nbytes


class LocalTransport(Transport):
    """Transport between objects of one process; everything completes inside post()."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._token = uuid.uuid4().hex  # tells a restarted peer from the one we connected to
        self._lock = threading.Lock()
        self._region: _Region | None = None
        self._peers: dict[str, tuple[LocalTransport, PeerInfo]] = {}
        self._states: dict[int, tuple[TransferState, int]] = {}  # handle -> (state, num blocks)
        self._notifs: list[tuple[str, bytes]] = []
        self._handle_ids = itertools.count(1)
        self._is_closed = False
        with _registry_lock:
            live = _registry.get(name)
            if live is not None:
                raise TransportError(f"a live local transport is already named {name!r}")
            _registry[name] = self

    # ---- setup ----------------------------------------------------------------------------

    def register(self, base_addr: int, num_blocks: int, block_nbytes: int) -> None:
        with self._lock:
            self._check_register(self._region, num_blocks, block_nbytes)
            self._region = _Region(base_addr, num_blocks, block_nbytes)

    def metadata(self) -> bytes:
        self._check_open()
        region = self._registered()
        body = {"name": self.name, "token": self._token, "num_blocks": region.num_blocks}
        body["block_nbytes"] = region.block_nbytes
        return _MAGIC + json.dumps(body).encode()

    def add_peer(self, metadata: bytes) -> PeerInfo:
        if not metadata.startswith(_MAGIC):
            raise TransportError("not local-transport metadata")
        body = json.loads(metadata[len(_MAGIC) :])
        with _registry_lock:
            peer = _registry.get(body["name"])
        if peer is None or peer._token != body["token"]:
            raise TransportError(f"local peer {body['name']!r} is gone")
        info = PeerInfo(body["name"], body["num_blocks"], body["block_nbytes"])
        with self._lock:
            self._check_open()
            self._peers[info.name] = (peer, info)
        return info

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._peers.pop(name, None)

    # ---- transfers ------------------------------------------------------------------------

    def post(
        self, op: Op, peer: str, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> int:
        with self._lock:
            target, info = self._known(self._peers, peer, "peer")
            region = self._registered()
            self._check_transfer(local_ids, remote_ids, region.num_blocks, info.num_blocks)
            handle = next(self._handle_ids)
        is_done = target._copy(op, self, local_ids, remote_ids, notif)
        state = TransferState.DONE if is_done else TransferState.ERR
        with self._lock:
            self._states[handle] = (state, len(local_ids))
        return handle

    def _copy(
        self,
        op: Op,
        initiator: LocalTransport,
        local_ids: list[int],
        remote_ids: list[int],
        notif: bytes,
    ) -> bool:
        """Run on the target: move the blocks, then queue the notif. False if we are closed."""
        with self._lock:
            if self._is_closed or self._region is None:
                return False
            mine, theirs = self._region, initiator._registered()
            for local_id, remote_id in zip(local_ids, remote_ids, strict=True):
                src, dst = mine.addr(remote_id), theirs.addr(local_id)
                if op is Op.WRITE:
                    src, dst = dst, src
                ctypes.memmove(dst, src, mine.block_nbytes)
            if notif:
                self._notifs.append((initiator.name, notif))
        return True

    def poll(self, handle: int) -> TransferState:
        return self._entry(handle)[0]

    def release(self, handle: int) -> None:
        with self._lock:
            self._states.pop(handle, None)

    def num_descriptors(self, handle: int) -> int:
        return self._entry(handle)[1]

    # ---- notifications --------------------------------------------------------------------

    def send_notif(self, peer: str, notif: bytes) -> None:
        with self._lock:
            target = self._known(self._peers, peer, "peer")[0]
        if not target._deliver(self.name, notif):
            raise TransportError(f"{self.name}: peer {peer!r} is gone")

    def _deliver(self, sender: str, notif: bytes) -> bool:
        with self._lock:
            if self._is_closed:
                return False
            self._notifs.append((sender, notif))
            return True

    def get_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            notifs, self._notifs = self._notifs, []
        return notifs

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._peers.clear()
            self._states.clear()
        with _registry_lock:
            if _registry.get(self.name) is self:
                del _registry[self.name]

    # ---- helpers --------------------------------------------------------------------------

    def _entry(self, handle: int) -> tuple[TransferState, int]:
        with self._lock:
            return self._known(self._states, handle, "handle")

    def _registered(self) -> _Region:
        if self._region is None:
            raise TransportError(f"{self.name}: register() the KV buffer first")
        return self._region
