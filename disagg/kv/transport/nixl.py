"""NIXL transport: one nixl_agent (UCX backend) per Transport, the whole KV buffer as one region.

Owns the agent, the prepared descriptor lists (local once at register(), remote once per peer at
add_peer()) and the transfer handles. Per transfer it only builds the request from index lists and
posts it. NIXL sends a transfer's notif when the initiator's poll() sees it complete, so
initiators must poll until DONE. It must never call check_remote_xfer_done(): get_notifs()
drains NIXL's queue and the two would steal notifications from each other. Peer failures
surface as ERR (or a refused post), never as a hang.
"""

from __future__ import annotations

import importlib
import ipaddress
import itertools
import logging
import os
import struct
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from disagg.kv.transport.base import Op, PeerInfo, TransferState, Transport, TransportError

__all__ = ["NixlTransport", "create_nixl_agent", "nixl_api"]

logger = logging.getLogger(__name__)

# magic, base_addr, num_blocks, block_nbytes, is_vram, device_id, len(name); then the name,
# then NIXL's agent metadata
_HEADER = struct.Struct("!4sQQQBHH")
_MAGIC = b"DKVN"
_MIN_PROGRESS_DELAY_US = 1000  # progress thread blocks in poll() instead of spinning (notes)
_STATES = {"PROC": TransferState.PROC, "DONE": TransferState.DONE, "ERR": TransferState.ERR}
_agent_lock = threading.Lock()  # create_nixl_agent swaps a class on the shared bindings module


def nixl_api() -> ModuleType:
    """NIXL's Python API module: the `nixl` meta package or the installed CUDA build of it.

    Without torch loaded, the meta package imports torch only to pick the build (3 s here), so
    such processes (tests, benchmarks) try the concrete builds first.
    """
    names = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
    if "torch" not in sys.modules:
        names = (*names[1:], names[0])
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransportError("NIXL is not installed (nixl-cu12)")


def _nixl_errors(api: ModuleType) -> tuple[type[BaseException], ...]:
    """The binding's exception classes (they derive from Exception directly, not a common base)."""
    bind = api.nixlBind
    found = [getattr(bind, n) for n in dir(bind) if n.startswith("nixl") and n.endswith("Error")]
    return (*found, RuntimeError, ValueError)


def create_nixl_agent(name: str, *, host: str = "127.0.0.1", capture_telemetry: bool = True) -> Any:
    """A UCX-backed nixl_agent with a progress thread that sleeps in poll() when idle.

    A loopback `host` keeps UCX's sockets (wire-up, notifications) on loopback; CMA moves the
    bytes (CMA on this host). UCX reads UCX_NET_DEVICES when an agent is created.

    nixl_agent hard-codes pthrDelay = 0, so its progress thread busy-spins a whole core; on a
    small host two agents then halve transfer bandwidth. We clamp the delay by handing the
    agent a config subclass for the duration of the constructor.
    """
    if _is_loopback(host):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    api = nixl_api()
    bind = api.nixlBind
    original = bind.nixlAgentConfig

    class _ClampedConfig(original):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # NIXL spells it so
            return original.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, delay_us: int) -> None:
            original.pthrDelay.__set__(self, max(int(delay_us), _MIN_PROGRESS_DELAY_US))

    config = api.nixl_agent_config(
        enable_prog_thread=True,
        enable_listen_thread=False,  # its listener binds 0.0.0.0; metadata goes by side channel
        backends=["UCX"],
        capture_telemetry=capture_telemetry,
    )
    with _agent_lock:
        bind.nixlAgentConfig = _ClampedConfig
        try:
            agent = api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = original
    if "UCX" not in agent.backends:
        raise TransportError(f"NIXL agent {name!r}: UCX backend failed to load")
    return agent


def _block_descs(base_addr: int, num_blocks: int, block_nbytes: int, device_id: int) -> np.ndarray:
    """One (addr, len, dev_id) row per block: the Nx3 layout prep_xfer_dlist takes."""
    descs = np.zeros((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_nbytes)
    descs[:, 1] = block_nbytes
    descs[:, 2] = device_id
    return descs


def _parse_device(device: str) -> tuple[str, int]:
    """ "cpu" -> ("DRAM", 0); "cuda" / "cuda:N" -> ("VRAM", N): NIXL's memory type and device."""
    if device == "cpu":
        return "DRAM", 0
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    return "VRAM", int(index or 0)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True, slots=True)
class _PeerMetadata:
    """What metadata() encodes: where the peer's blocks live, and how NIXL reaches it."""

    info: PeerInfo
    base_addr: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    agent_md: bytes


@dataclass(slots=True)
class _Peer:
    info: PeerInfo
    metadata: bytes  # exactly what add_peer got: identical bytes mean nothing to refresh
    dlist: Any  # prepped remote descriptor list, one entry per remote block


@dataclass(slots=True)
class _Xfer:
    state: TransferState
    num_descriptors: int  # len(ids) until telemetry reports NIXL's count after merging
    handle: Any = None  # nixl_xfer_handle, None if creating it failed


class NixlTransport(Transport):
    """KV blocks over NIXL. All agent calls run under one lock: the agent is created without
    NIXL's own thread synchronization, and the engine loop and connector threads share it."""

    def __init__(self, name: str, *, host: str = "127.0.0.1", device: str = "cpu") -> None:
        self.name = name
        self._mem_type, self._device_id = _parse_device(device)
        self._errors = _nixl_errors(nixl_api())
        self._agent = create_nixl_agent(name, host=host)
        self._lock = threading.Lock()
        self._region: tuple[int, int, int] | None = None  # base_addr, num_blocks, block_nbytes
        self._reg_descs: Any = None
        self._local_dlist: Any = None
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._handle_ids = itertools.count(1)
        self._is_closed = False

    # ---- setup ----------------------------------------------------------------------------

    def register(self, base_addr: int, num_blocks: int, block_nbytes: int) -> None:
        with self._lock:
            self._check_register(self._region, num_blocks, block_nbytes)
            region = [(base_addr, num_blocks * block_nbytes, self._device_id, "")]
            descs = _block_descs(base_addr, num_blocks, block_nbytes, self._device_id)
            try:
                self._reg_descs = self._agent.register_memory(region, self._mem_type)
                self._local_dlist = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", descs, self._mem_type
                )
            except self._errors as exc:
                raise TransportError(f"{self.name}: register failed: {exc!r}") from exc
            self._region = (base_addr, num_blocks, block_nbytes)

    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            base_addr, num_blocks, block_nbytes = self._registered()
            agent_md = self._agent.get_agent_metadata()
        name = self.name.encode()
        is_vram = self._mem_type == "VRAM"
        header = _HEADER.pack(
            _MAGIC, base_addr, num_blocks, block_nbytes, is_vram, self._device_id, len(name)
        )
        return header + name + agent_md

    def add_peer(self, metadata: bytes) -> PeerInfo:
        remote = _unpack_metadata(metadata)
        info = remote.info
        with self._lock:
            self._check_open()
            self._check_peer_blocks(info, self._registered()[2])
            old = self._peers.get(info.name)
            if old is not None and old.metadata == metadata:
                return old.info
            if old is not None:  # restarted peer: its old endpoint and addresses are stale
                self._forget(self._peers.pop(info.name))
            dlist = self._load_peer(remote)
            self._peers[info.name] = _Peer(info, metadata, dlist)
        return info

    def _load_peer(self, remote: _PeerMetadata) -> Any:
        """Load the agent and prepare one remote descriptor per block (lock held)."""
        info = remote.info
        try:
            loaded = _as_str(self._agent.add_remote_agent(remote.agent_md))
        except self._errors as exc:
            raise TransportError(f"{self.name}: add_peer {info.name!r}: {exc!r}") from exc
        try:
            if loaded != info.name:
                raise TransportError(f"metadata names {info.name!r} but NIXL loaded {loaded!r}")
            descs = _block_descs(
                remote.base_addr, info.num_blocks, info.block_nbytes, remote.device_id
            )
            return self._agent.prep_xfer_dlist(info.name, descs, remote.mem_type)
        except (TransportError, *self._errors) as exc:
            self._agent.remove_remote_agent(loaded)  # else a retry is refused as a duplicate
            raise TransportError(f"{self.name}: add_peer {info.name!r}: {exc!r}") from exc

    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
            if peer is not None and not self._is_closed:
                self._forget(peer)

    def _forget(self, peer: _Peer) -> None:
        """Drop a peer's prepared list and NIXL's endpoint to it (lock held)."""
        try:
            peer.dlist.release()
            self._agent.remove_remote_agent(peer.info.name)
        except self._errors as exc:
            logger.warning("%s: forgetting peer %s: %r", self.name, peer.info.name, exc)

    # ---- transfers ------------------------------------------------------------------------

    def post(
        self, op: Op, peer: str, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> int:
        with self._lock:
            target = self._known(self._peers, peer, "peer")
            self._check_transfer(
                local_ids, remote_ids, self._registered()[1], target.info.num_blocks
            )
            handle_id = next(self._handle_ids)
            xfer = _Xfer(TransferState.ERR, len(local_ids))
            self._xfers[handle_id] = xfer
            try:
                xfer.handle = self._agent.make_prepped_xfer(
                    op.value,
                    self._local_dlist,
                    np.asarray(local_ids, dtype=np.int32),
                    target.dlist,
                    np.asarray(remote_ids, dtype=np.int32),
                )
                xfer.state = _STATES[self._agent.transfer(xfer.handle, notif)]
            except self._errors as exc:  # e.g. the peer disconnected: fails this transfer only
                logger.warning("%s: %s to %s failed at post: %r", self.name, op.value, peer, exc)
            self._settle(xfer)
        return handle_id

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            xfer = self._known(self._xfers, handle, "handle")
            if xfer.state is TransferState.PROC:
                try:
                    xfer.state = _STATES[self._agent.check_xfer_state(xfer.handle)]
                except self._errors as exc:
                    logger.warning("%s: transfer %d failed: %r", self.name, handle, exc)
                    xfer.state = TransferState.ERR
                self._settle(xfer)
            return xfer.state

    def _settle(self, xfer: _Xfer) -> None:
        """On DONE, replace the id count by NIXL's descriptor count (after its merging)."""
        if xfer.state is TransferState.DONE and xfer.handle is not None:
            try:
                xfer.num_descriptors = int(self._agent.get_xfer_telemetry(xfer.handle).descCount)
            except self._errors:
                pass  # telemetry off or unsupported: keep len(ids)

    def release(self, handle: int) -> None:
        if self.poll(handle) is TransferState.PROC:
            raise TransportError(f"{self.name}: release of transfer {handle} still in flight")
        with self._lock:
            xfer = self._xfers.pop(handle, None)
            if xfer is not None and xfer.handle is not None:
                self._release_handle(handle, xfer)

    def _release_handle(self, handle: int, xfer: _Xfer) -> None:
        try:
            self._agent.release_xfer_handle(xfer.handle)
        except self._errors as exc:
            logger.warning("%s: releasing transfer %d: %r", self.name, handle, exc)

    def num_descriptors(self, handle: int) -> int:
        with self._lock:
            return self._known(self._xfers, handle, "handle").num_descriptors

    # ---- notifications --------------------------------------------------------------------

    def send_notif(self, peer: str, notif: bytes) -> None:
        with self._lock:
            self._known(self._peers, peer, "peer")  # NIXL notifies only agents it loaded
            try:
                self._agent.send_notif(peer, notif)
            except self._errors as exc:
                raise TransportError(f"{self.name}: send_notif to {peer!r}: {exc!r}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            try:
                new = self._agent.get_new_notifs()
            except self._errors as exc:
                raise TransportError(f"{self.name}: get_notifs: {exc!r}") from exc
        return [(_as_str(sender), msg) for sender, msgs in new.items() for msg in msgs]

    # ---- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            for handle, xfer in self._xfers.items():
                if xfer.handle is not None:  # NIXL cancels what is still in flight
                    self._release_handle(handle, xfer)
            self._xfers.clear()
            for peer in self._peers.values():
                self._forget(peer)
            self._peers.clear()
            self._release_region()
            self._agent = None  # the binding's destructor stops the progress thread

    def _release_region(self) -> None:
        if self._region is None:
            return
        try:
            self._local_dlist.release()
            self._agent.deregister_memory(self._reg_descs)
        except self._errors as exc:
            logger.warning("%s: deregistering the KV buffer: %r", self.name, exc)

    # ---- helpers (lock held) --------------------------------------------------------------

    def _registered(self) -> tuple[int, int, int]:
        if self._region is None:
            raise TransportError(f"{self.name}: register() the KV buffer first")
        return self._region


def _unpack_metadata(metadata: bytes) -> _PeerMetadata:
    """Inverse of NixlTransport.metadata(). Raises TransportError."""
    if len(metadata) < _HEADER.size or not metadata.startswith(_MAGIC):
        raise TransportError("not NIXL-transport metadata")
    _, base_addr, num_blocks, block_nbytes, is_vram, device_id, name_len = _HEADER.unpack_from(
        metadata
    )
    name = metadata[_HEADER.size : _HEADER.size + name_len].decode()
    info = PeerInfo(name, num_blocks, block_nbytes)
    mem_type = "VRAM" if is_vram else "DRAM"
    return _PeerMetadata(info, base_addr, mem_type, device_id, metadata[_HEADER.size + name_len :])


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
