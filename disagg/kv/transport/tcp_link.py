"""The TCP transport's initiator side: one worker thread and one cached socket per peer, so
post() only queues a job and never blocks on the network. Every new socket runs tcp_auth.py's
handshake before its first request, so we never send KV to (or read it from) a peer that does
not share our secret.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import disagg.kv.transport.tcp_wire as wire
from disagg.kv.transport.base import PeerInfo, TransportError
from disagg.kv.transport.tcp_auth import authenticate

__all__ = ["Job", "PeerLink", "Region"]


@dataclass(frozen=True, slots=True)
class Region:
    view: memoryview  # the whole registered buffer, writable
    num_blocks: int
    block_nbytes: int

    def blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        n = self.block_nbytes
        return [self.view[i * n : (i + 1) * n] for i in block_ids]


@dataclass(slots=True)
class Job:
    op: int  # wire.OP_READ | OP_WRITE | OP_NOTIF
    local_ids: list[int]
    remote_ids: list[int]
    notif: bytes
    handle: int | None = None  # transfer handle; None for send_notif
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""  # why it failed ("" = ok)


class PeerLink:
    """The initiator side of one peer: a job queue, its worker thread and a cached socket."""

    def __init__(
        self,
        name: str,  # ours, sent with every request
        info: PeerInfo,
        addr: tuple[str, int],
        io_timeout_s: float,
        secret: str | None,  # the cluster's shared secret; None = no handshake proof
        region: Callable[[], Region],  # our registered buffer (raises once closed)
        finish: Callable[[Job], None],  # called with every job, done or failed
    ) -> None:
        self.name, self.info, self.addr, self.io_timeout_s = name, info, addr, io_timeout_s
        self._secret, self._region, self._finish = secret, region, finish
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # None = stop; always the last item
        self.sock: socket.socket | None = None
        self.is_stopped = False
        self._lock = threading.Lock()  # orders submit() against stop()
        self.thread = threading.Thread(
            target=self._work, name=f"kv-tcp-{name}->{info.name}", daemon=True
        )

    def start(self) -> None:
        """Start the worker thread; jobs submitted before it wait in the queue."""
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self.is_stopped:
                self.jobs.put(job)
                return
        job.error = f"peer {self.info.name!r} was removed"
        self._finish(job)

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
            self._finish(job)
        self._disconnect()

    def _run_safely(self, job: Job) -> str:
        try:
            self._run(job, self._connect())
            return ""
        except (OSError, TransportError) as exc:  # ConnectionError and timeouts are OSErrors
            self._disconnect()  # the stream may be mid-frame: never reuse it
            return f"{type(exc).__name__}: {exc}"

    def _run(self, job: Job, sock: socket.socket) -> None:
        name = self.name
        if job.op == wire.OP_WRITE:
            request = wire.encode_request(wire.OP_WRITE, name, job.remote_ids, job.notif)
            wire.send_all(sock, [request, *self._region().blocks(job.local_ids)])
            wire.read_reply(sock)
            return
        if job.op == wire.OP_READ:
            wire.send_all(sock, [wire.encode_request(wire.OP_READ, name, job.remote_ids, b"")])
            wire.read_reply(sock)
            wire.recv_into_all(sock, self._region().blocks(job.local_ids))
            if not job.notif:
                return
        # the READ's notif goes only once its bytes have landed here
        wire.send_all(sock, [wire.encode_request(wire.OP_NOTIF, name, [], job.notif)])
        wire.read_reply(sock)

    def _connect(self) -> socket.socket:
        if self.sock is None:
            sock = socket.create_connection(self.addr, timeout=self.io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock  # set first, so stop() can interrupt the handshake too
            authenticate(sock, self._secret, self.name, self.io_timeout_s)  # raises AuthError
            sock.settimeout(self.io_timeout_s)  # the handshake left a shorter one behind
        return self.sock

    def _disconnect(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
