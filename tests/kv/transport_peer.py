"""A transport peer for the conformance suite: in its own process (spawn) for nixl and tcp,
in this process for local, driven by the same small command set either way.

Owns only test plumbing: a registered numpy buffer, a command loop over a pipe, and
bounded waits (every call has a timeout; a peer that does not answer fails the test).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from disagg.kv.transport import Op, TransferState, Transport, make_transport

__all__ = ["BLOCK_NBYTES", "NUM_BLOCKS", "Peer", "make_buffer", "pattern", "wait_done"]

NUM_BLOCKS = 64
BLOCK_NBYTES = 16 * 1024
_PAGE = 4096


def make_buffer(num_blocks: int = NUM_BLOCKS, block_nbytes: int = BLOCK_NBYTES) -> np.ndarray:
    """A page-aligned [num_blocks, block_nbytes] uint8 array (a view into a larger one)."""
    raw = np.zeros(num_blocks * block_nbytes + _PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _PAGE
    return raw[offset : offset + num_blocks * block_nbytes].reshape(num_blocks, block_nbytes)


def pattern(seed: int, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    """Distinct pseudo-random bytes per (seed, block), so a misplaced block cannot pass."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_blocks, BLOCK_NBYTES), dtype=np.uint8)


def wait_done(transport: Transport, handle: int, timeout_s: float = 10.0) -> TransferState:
    """Poll until the transfer settles; PROC after timeout_s means it hung."""
    deadline = time.monotonic() + timeout_s
    while (state := transport.poll(handle)) is TransferState.PROC:
        if time.monotonic() > deadline:
            break
        time.sleep(0.001)
    return state


class _Commands:
    """What a peer can be asked to do; runs wherever the transport lives."""

    def __init__(self, kind: str, name: str, seed: int) -> None:
        self.buffer = make_buffer()
        self.buffer[:] = pattern(seed)
        self.transport = make_transport(kind, name)
        self.transport.register(self.buffer.ctypes.data, NUM_BLOCKS, BLOCK_NBYTES)
        self.metadata = self.transport.metadata()

    def fill(self, seed: int) -> None:
        self.buffer[:] = pattern(seed)

    def blocks(self, ids: list[int]) -> bytes:
        return self.buffer[ids].tobytes()

    def add_peer(self, metadata: bytes) -> str:
        return self.transport.add_peer(metadata).name

    def post_wait(
        self, op: str, peer: str, local: list[int], remote: list[int], notif: bytes
    ) -> str:
        handle = self.transport.post(Op(op), peer, local, remote, notif)
        state = wait_done(self.transport, handle)
        if state is not TransferState.PROC:
            self.transport.release(handle)
        return state.value

    def send_notif(self, peer: str, notif: bytes) -> None:
        self.transport.send_notif(peer, notif)

    def wait_notifs(self, expected: dict[bytes, list[int]], timeout_s: float) -> dict[bytes, Any]:
        """Collect notifs for `timeout_s` (or until all expected came, plus a 0.2 s watch for
        duplicates). For each message: (times received, sender, bytes of its blocks at the
        moment it was first seen)."""
        seen: dict[bytes, list[Any]] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for sender, msg in self.transport.get_notifs():
                if msg in seen:
                    seen[msg][0] += 1
                else:  # snapshot now: the bytes must already be there
                    seen[msg] = [1, sender, self.buffer[expected.get(msg, [])].tobytes()]
            if set(expected) <= set(seen):
                deadline = min(deadline, time.monotonic() + 0.2)
            time.sleep(0.001)
        return {msg: tuple(entry) for msg, entry in seen.items()}

    def close(self) -> None:
        self.transport.close()


def _serve(conn: Connection, kind: str, name: str, seed: int) -> None:
    """Child process main: answer ("ok", result) or ("err", repr) per command until close."""
    commands = _Commands(kind, name, seed)
    conn.send(("ok", commands.metadata))
    while True:
        method, args = conn.recv()
        try:
            result = getattr(commands, method)(*args)
        except Exception as exc:  # report any failure to the test instead of dying silently
            conn.send(("err", repr(exc)))
            continue
        conn.send(("ok", result))
        if method == "close":
            return


class Peer:
    """One peer transport: a spawned process for nixl/tcp, an in-process object for local."""

    def __init__(self, kind: str, name: str, seed: int) -> None:
        self.kind, self.name = kind, name
        self._local: _Commands | None = None
        self._metadata: bytes | None = None
        if kind == "local":
            self._local = _Commands(kind, name, seed)
            self._metadata = self._local.metadata
            return
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, kind, name, seed), daemon=True)
        self._proc.start()
        child.close()

    @property
    def metadata(self) -> bytes:
        if self._metadata is None:
            self._metadata = self._receive(60.0)  # spawn + imports + agent creation
        return self._metadata

    def call(self, method: str, *args: Any, timeout_s: float = 20.0) -> Any:
        if self._local is not None:
            return getattr(self._local, method)(*args)
        self.metadata  # noqa: B018 (the first message is the metadata)
        self._conn.send((method, args))
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.name} did not answer within {timeout_s} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer {self.name}: {value}")
        return value

    def kill(self) -> None:
        """Die without cleanup (SIGKILL); the local kind can only close."""
        if self._local is not None:
            self._local.close()
            return
        self._proc.kill()
        self._proc.join(10.0)
        assert not self._proc.is_alive(), f"peer {self.name} survived SIGKILL"

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            return
        if self._proc.is_alive():
            try:
                self.call("close", timeout_s=10.0)
            except (TimeoutError, RuntimeError, OSError, EOFError):
                pass
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._conn.close()
