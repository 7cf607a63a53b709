"""TCP transport: the pure-Python fallback for hosts without NIXL, same semantics.

Owns a listener thread (one server thread per accepted connection) that serves READ/WRITE/NOTIF
requests against the registered buffer, and one worker thread per peer that does the initiator's
socket I/O, so post() never blocks. Frames are length-prefixed; block bytes go straight between
the socket and the buffer (sendmsg / recvmsg_into over memoryviews). A failure turns the transfer
into ERR; every socket wait is bounded by io_timeout_s, so nothing hangs on a dead peer.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from disagg.kv.transport.base import Op, PeerInfo, TransferState, Transport, TransportError
from disagg.kv.transport.local import buffer_view, check_region, check_transfer_args

__all__ = ["TcpTransport"]

logger = logging.getLogger(__name__)

_MAGIC = b"DKVT"
_REQUEST = struct.Struct("!BHII")  # op, len(sender name), num block ids, len(notif)
_REPLY = struct.Struct("!BI")  # status (0 = ok), len(error text); READ's block bytes follow
_OP_READ, _OP_WRITE, _OP_NOTIF = 1, 2, 3
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class _RemoteError(TransportError):
    """The peer answered a request with an error."""


# ---- framing ---------------------------------------------------------------------------------


def _encode_request(op: int, sender: str, block_ids: Sequence[int], notif: bytes) -> bytes:
    name = sender.encode()
    ids = np.asarray(block_ids, dtype=">u4").tobytes()
    return _REQUEST.pack(op, len(name), len(block_ids), len(notif)) + name + ids + notif


def _advance(pending: collections.deque[memoryview], nbytes: int) -> None:
    """Drop `nbytes` from the front of a queue of buffers (after a partial send/receive)."""
    while nbytes:
        head = pending[0]
        if nbytes >= len(head):
            nbytes -= len(head)
            pending.popleft()
        else:
            pending[0] = head[nbytes:]
            nbytes = 0


def _send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send every buffer, gathering up to IOV_MAX of them per syscall."""
    pending = collections.deque(memoryview(b).cast("B") for b in buffers)
    while pending:
        _advance(pending, sock.sendmsg(list(itertools.islice(pending, _IOV_MAX))))


def _recv_into_all(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view from the socket, scattering up to IOV_MAX of them per syscall."""
    pending = collections.deque(views)
    while pending:
        nbytes = sock.recvmsg_into(list(itertools.islice(pending, _IOV_MAX)))[0]
        if nbytes == 0:
            raise ConnectionError("connection closed mid-frame")
        _advance(pending, nbytes)


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    if nbytes:
        _recv_into_all(sock, [memoryview(data)])
    return bytes(data)


def _send_reply(sock: socket.socket, error: str = "") -> None:
    text = error.encode()
    sock.sendall(_REPLY.pack(1 if error else 0, len(text)) + text)


def _read_reply(sock: socket.socket) -> None:
    status, text_len = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
    if status:
        raise _RemoteError(_recv_exact(sock, text_len).decode(errors="replace"))


# ---- state records ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Region:
    view: memoryview  # the whole registered buffer, writable
    num_blocks: int
    block_nbytes: int

    def blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        n = self.block_nbytes
        return [self.view[i * n : (i + 1) * n] for i in block_ids]


@dataclass(slots=True)
class _Job:
    op: int  # _OP_READ | _OP_WRITE | _OP_NOTIF
    local_ids: list[int]
    remote_ids: list[int]
    notif: bytes
    handle: int | None = None  # transfer handle; None for send_notif
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""  # why it failed ("" = ok)


class _PeerLink:
    """The initiator side of one peer: a job queue, its worker thread and a cached socket."""

    def __init__(self, owner: TcpTransport, info: PeerInfo, addr: tuple[str, int]) -> None:
        self.owner, self.info, self.addr = owner, info, addr
        self.jobs: queue.Queue[_Job | None] = queue.Queue()  # None = stop; always the last item
        self.sock: socket.socket | None = None
        self.is_stopped = False
        self._lock = threading.Lock()  # orders submit() against stop()
        self.thread = threading.Thread(
            target=self._work, name=f"kv-tcp-{owner.name}->{info.name}", daemon=True
        )
        self.thread.start()

    def submit(self, job: _Job) -> None:
        with self._lock:
            if not self.is_stopped:
                self.jobs.put(job)
                return
        job.error = f"peer {self.info.name!r} was removed"
        self.owner._finish(job)

    def stop(self) -> None:
        """Fail queued jobs and interrupt the one in progress; the thread then exits."""
        with self._lock:
            self.is_stopped = True
            self.jobs.put(None)
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a worker blocked in send/recv
            except OSError:
                pass

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.is_stopped:
                job.error = f"peer {self.info.name!r} was removed"
            else:
                job.error = self._run_safely(job)
            self.owner._finish(job)
        self._disconnect()

    def _run_safely(self, job: _Job) -> str:
        try:
            self._run(job, self._connect())
            return ""
        except (OSError, TransportError) as exc:  # ConnectionError and timeouts are OSErrors
            self._disconnect()  # the stream may be mid-frame: never reuse it
            return f"{type(exc).__name__}: {exc}"

    def _run(self, job: _Job, sock: socket.socket) -> None:
        name = self.owner.name
        if job.op == _OP_WRITE:
            request = _encode_request(_OP_WRITE, name, job.remote_ids, job.notif)
            _send_all(sock, [request, *self.owner._region_or_raise().blocks(job.local_ids)])
            _read_reply(sock)
            return
        if job.op == _OP_READ:
            _send_all(sock, [_encode_request(_OP_READ, name, job.remote_ids, b"")])
            _read_reply(sock)
            _recv_into_all(sock, self.owner._region_or_raise().blocks(job.local_ids))
            if not job.notif:
                return
        # the READ's notif goes only once its bytes have landed here
        _send_all(sock, [_encode_request(_OP_NOTIF, name, [], job.notif)])
        _read_reply(sock)

    def _connect(self) -> socket.socket:
        if self.sock is None:
            timeout_s = self.owner.io_timeout_s
            sock = socket.create_connection(self.addr, timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock
        return self.sock

    def _disconnect(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


class TcpTransport(Transport):
    """KV blocks over plain TCP sockets; the listener starts at construction so notifications
    can arrive before register()."""

    def __init__(self, name: str, *, host: str = "127.0.0.1", io_timeout_s: float = 10.0) -> None:
        self.name = name
        self.io_timeout_s = io_timeout_s  # bounds every connect/send/recv on both sides
        self._lock = threading.Lock()
        self._region: _Region | None = None
        self._links: dict[str, _PeerLink] = {}
        self._link_metadata: dict[str, bytes] = {}
        self._xfers: dict[int, tuple[TransferState, int]] = {}  # handle -> (state, num blocks)
        self._notifs: list[tuple[str, bytes]] = []
        self._handle_ids = itertools.count(1)
        self._server_socks: set[socket.socket] = set()
        self._server_threads: list[threading.Thread] = []
        self._is_closed = False
        self._listener = socket.create_server((host, 0))
        self._addr: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-tcp-listen-{name}", daemon=True
        )
        self._accept_thread.start()

    # ---- setup ----------------------------------------------------------------------------

    def register(self, base_addr: int, num_blocks: int, block_nbytes: int) -> None:
        check_region(num_blocks, block_nbytes)
        with self._lock:
            self._check_open()
            if self._region is not None:
                raise TransportError(f"{self.name}: register() called twice")
            view = buffer_view(base_addr, num_blocks * block_nbytes)
            self._region = _Region(view, num_blocks, block_nbytes)

    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            region = self._region_or_raise()
        host, port = self._addr
        body = {"name": self.name, "host": host, "port": port}
        body.update(num_blocks=region.num_blocks, block_nbytes=region.block_nbytes)
        return _MAGIC + json.dumps(body).encode()

    def add_peer(self, metadata: bytes) -> PeerInfo:
        info, addr = _unpack_metadata(metadata)
        with self._lock:
            self._check_open()
            block_nbytes = self._region_or_raise().block_nbytes
            if info.block_nbytes != block_nbytes:
                raise TransportError(
                    f"peer {info.name!r} has {info.block_nbytes}-byte blocks, we {block_nbytes}"
                )
            if self._link_metadata.get(info.name) == metadata:
                return info
            old = self._links.pop(info.name, None)
            if old is not None:  # restarted peer: its old address is stale
                old.stop()
            self._links[info.name] = _PeerLink(self, info, addr)
            self._link_metadata[info.name] = metadata
        return info

    def remove_peer(self, name: str) -> None:
        with self._lock:
            link = self._links.pop(name, None)
            self._link_metadata.pop(name, None)
        if link is not None:
            link.stop()

    # ---- transfers (initiator) ------------------------------------------------------------

    def post(
        self, op: Op, peer: str, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> int:
        with self._lock:
            self._check_open()
            link = self._link(peer)
            num_local = self._region_or_raise().num_blocks
            check_transfer_args(local_ids, remote_ids, num_local, link.info.num_blocks)
            handle = next(self._handle_ids)
            self._xfers[handle] = (TransferState.PROC, len(local_ids))
        code = _OP_READ if op is Op.READ else _OP_WRITE
        link.submit(_Job(code, list(local_ids), list(remote_ids), bytes(notif), handle))
        return handle

    def _finish(self, job: _Job) -> None:
        """Called by a peer worker when a job ended (job.error == "" on success)."""
        if job.error:
            logger.warning("%s: tcp job to peer failed: %s", self.name, job.error)
        if job.handle is not None:
            state = TransferState.ERR if job.error else TransferState.DONE
            with self._lock:
                if job.handle in self._xfers:
                    self._xfers[job.handle] = (state, self._xfers[job.handle][1])
        job.done.set()

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            return self._xfer(handle)[0]

    def release(self, handle: int) -> None:
        with self._lock:
            if self._xfer(handle)[0] is TransferState.PROC:
                raise TransportError(f"{self.name}: release of transfer {handle} still in flight")
            del self._xfers[handle]

    def num_descriptors(self, handle: int) -> int:
        with self._lock:
            return self._xfer(handle)[1]

    # ---- notifications --------------------------------------------------------------------

    def send_notif(self, peer: str, notif: bytes) -> None:
        """Queued behind earlier posts to the same peer; waits until the peer has it."""
        with self._lock:
            self._check_open()
            link = self._link(peer)
        job = _Job(_OP_NOTIF, [], [], bytes(notif))
        link.submit(job)
        if not job.done.wait(2 * self.io_timeout_s):
            raise TransportError(f"{self.name}: send_notif to {peer!r} timed out")
        if job.error:
            raise TransportError(f"{self.name}: send_notif to {peer!r}: {job.error}")

    def get_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            notifs, self._notifs = self._notifs, []
        return notifs

    # ---- serving (target) -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # close() shut the listener down
                return
            thread = threading.Thread(
                target=self._serve, args=(sock,), name=f"kv-tcp-serve-{self.name}", daemon=True
            )
            with self._lock:
                if self._is_closed:
                    sock.close()
                    return
                self._server_socks.add(sock)
                self._server_threads = [t for t in self._server_threads if t.is_alive()]
                self._server_threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while self._serve_one(sock):
                pass
        except TransportError as exc:  # a bad request: tell the initiator, then hang up
            logger.warning("%s: refused a request: %s", self.name, exc)
            try:
                _send_reply(sock, str(exc))
            except OSError:
                pass
        except OSError as exc:  # the initiator went away or stalled past io_timeout_s
            logger.debug("%s: connection ended: %r", self.name, exc)
        finally:
            with self._lock:
                self._server_socks.discard(sock)
            sock.close()

    def _serve_one(self, sock: socket.socket) -> bool:
        """Serve one request; False when the initiator closed the connection cleanly."""
        sock.settimeout(None)  # an idle connection between requests is normal
        header = sock.recv(_REQUEST.size, socket.MSG_WAITALL)
        if not header:
            return False
        if len(header) < _REQUEST.size:
            raise ConnectionError("connection closed mid-header")
        sock.settimeout(self.io_timeout_s)
        op, name_len, num_ids, notif_len = _REQUEST.unpack(header)
        body = _recv_exact(sock, name_len + 4 * num_ids + notif_len)
        sender = body[:name_len].decode()
        block_ids = np.frombuffer(body, ">u4", num_ids, name_len).tolist()
        notif = body[name_len + 4 * num_ids :]
        if op == _OP_READ:
            _send_all(sock, [_REPLY.pack(0, 0), *self._served_blocks(block_ids)])
        elif op == _OP_WRITE:
            _recv_into_all(sock, self._served_blocks(block_ids))
            self._deliver(sender, notif)  # only now: the bytes are in our buffer
            _send_reply(sock)
        elif op == _OP_NOTIF:
            self._deliver(sender, notif)
            _send_reply(sock)
        else:
            raise TransportError(f"unknown request op {op}")
        return True

    def _served_blocks(self, block_ids: list[int]) -> list[memoryview]:
        with self._lock:
            region = self._region_or_raise()
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= region.num_blocks):
            raise TransportError(f"block ids out of range [0, {region.num_blocks})")
        return region.blocks(block_ids)

    def _deliver(self, sender: str, notif: bytes) -> None:
        if notif:
            with self._lock:
                self._notifs.append((sender, notif))

    # ---- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every thread; waits up to ~2 s for them so none touches the buffer after."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            links = list(self._links.values())
            self._links.clear()
            self._link_metadata.clear()
            socks, threads = list(self._server_socks), list(self._server_threads)
        for link in links:
            link.stop()
        for sock in [self._listener, *socks]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes accept()/recv() blocked in other threads
            except OSError:
                pass
        self._listener.close()
        for thread in [self._accept_thread, *threads, *(link.thread for link in links)]:
            thread.join(timeout=2.0)

    # ---- helpers --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._is_closed:
            raise TransportError(f"{self.name}: transport is closed")

    def _region_or_raise(self) -> _Region:
        if self._region is None or self._is_closed:
            raise TransportError(f"{self.name}: no KV buffer registered (or closed)")
        return self._region

    def _link(self, peer: str) -> _PeerLink:
        if peer not in self._links:
            raise TransportError(f"{self.name}: unknown peer {peer!r}")
        return self._links[peer]

    def _xfer(self, handle: int) -> tuple[TransferState, int]:
        self._check_open()
        if handle not in self._xfers:
            raise TransportError(f"{self.name}: unknown handle {handle}")
        return self._xfers[handle]


def _unpack_metadata(metadata: bytes) -> tuple[PeerInfo, tuple[str, int]]:
    """-> (PeerInfo, (host, port) of the peer's listener). Raises TransportError."""
    if not metadata.startswith(_MAGIC):
        raise TransportError("not TCP-transport metadata")
    try:
        body = json.loads(metadata[len(_MAGIC) :])
        info = PeerInfo(str(body["name"]), int(body["num_blocks"]), int(body["block_nbytes"]))
        return info, (str(body["host"]), int(body["port"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"malformed TCP-transport metadata: {exc!r}") from exc
