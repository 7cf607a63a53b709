"""TCP transport: the pure-Python fallback for hosts without NIXL, same semantics.

Owns a listener thread (one server thread per accepted connection, at most max_num_connections
at once: past that a connection is hung up on, logged and counted) that serves READ/WRITE/NOTIF
requests against the registered buffer, but only after tcp_auth.py's handshake admitted the
peer (same shared secret, or none on both sides); tcp_link.py does the initiator's socket I/O on
one worker per peer, so post() never blocks; tcp_wire.py is the frame format. A failure turns the
transfer into ERR; every socket wait is bounded by io_timeout_s, so nothing hangs on a dead peer.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import threading

import numpy as np

import disagg.kv.transport.tcp_wire as wire
from disagg.kv.transport.base import Op, PeerInfo, TransferState, Transport, TransportError
from disagg.kv.transport.local import buffer_view
from disagg.kv.transport.tcp_auth import admit
from disagg.kv.transport.tcp_link import Job, PeerLink, Region

__all__ = ["TcpTransport"]

logger = logging.getLogger(__name__)

_MAGIC = b"DKVT"
# Each peer's link keeps one connection to us, so a cluster needs about one per peer; the cap
# bounds the serving threads a flood of connections (silent ones held through the handshake's
# timeout) could start.
MAX_NUM_CONNECTIONS = 256
_LOG_REFUSAL_EVERY = 100  # a flood must not flood the log too: the first, then every 100th


class TcpTransport(Transport):
    """KV blocks over plain TCP sockets; the listener binds at construction and serves from
    start() on (before register(): notifications may come first). With a `secret`, only peers
    holding the same one are served or sent to; None (or "") means no handshake proof, and then
    peers must have none either. At most `max_num_connections` connections are served at once."""

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        io_timeout_s: float = 10.0,
        secret: str | None = None,
        max_num_connections: int = MAX_NUM_CONNECTIONS,
    ) -> None:
        if max_num_connections <= 0:
            raise ValueError(f"max_num_connections must be > 0, got {max_num_connections}")
        self.name = name
        self.io_timeout_s = io_timeout_s  # bounds every connect/send/recv on both sides
        self.max_num_connections = max_num_connections
        self._num_refused = 0  # connections hung up on at the cap; only the accept thread writes
        self._secret = secret or None  # an empty key proves nothing: treat it as none
        self._lock = threading.Lock()
        self._region: Region | None = None
        self._links: dict[str, PeerLink] = {}
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

    def start(self) -> None:
        """Start accepting connections (make_transport calls it)."""
        self._accept_thread.start()

    # ---- setup ----------------------------------------------------------------------------

    def register(self, base_addr: int, num_blocks: int, block_nbytes: int) -> None:
        with self._lock:
            self._check_register(self._region, num_blocks, block_nbytes)
            view = buffer_view(base_addr, num_blocks * block_nbytes)
            self._region = Region(view, num_blocks, block_nbytes)

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
            self._check_peer_blocks(info, self._region_or_raise().block_nbytes)
            if self._link_metadata.get(info.name) == metadata:
                return info
            old = self._links.pop(info.name, None)
            if old is not None:  # restarted peer: its old address is stale
                old.stop()
            link = PeerLink(self.name, info, addr, self.io_timeout_s, self._secret,
                            self._region_or_raise, self._finish)  # fmt: skip
            link.start()
            self._links[info.name] = link
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
            link = self._known(self._links, peer, "peer")
            num_local = self._region_or_raise().num_blocks
            self._check_transfer(local_ids, remote_ids, num_local, link.info.num_blocks)
            handle = next(self._handle_ids)
            self._xfers[handle] = (TransferState.PROC, len(local_ids))
        code = wire.OP_READ if op is Op.READ else wire.OP_WRITE
        link.submit(Job(code, list(local_ids), list(remote_ids), bytes(notif), handle))
        return handle

    def _finish(self, job: Job) -> None:
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
            return self._known(self._xfers, handle, "handle")[0]

    def release(self, handle: int) -> None:
        with self._lock:
            if self._known(self._xfers, handle, "handle")[0] is TransferState.PROC:
                raise TransportError(f"{self.name}: release of transfer {handle} still in flight")
            del self._xfers[handle]

    def num_descriptors(self, handle: int) -> int:
        with self._lock:
            return self._known(self._xfers, handle, "handle")[1]

    # ---- notifications --------------------------------------------------------------------

    def send_notif(self, peer: str, notif: bytes) -> None:
        """Queued behind earlier posts to the same peer; waits until the peer has it."""
        with self._lock:
            link = self._known(self._links, peer, "peer")
        job = Job(wire.OP_NOTIF, [], [], bytes(notif))
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

    @property
    def num_refused_connections(self) -> int:
        return self._num_refused

    @property
    def num_open_connections(self) -> int:
        """Accepted connections being served now (in their handshake or after it)."""
        with self._lock:
            return len(self._server_socks)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:  # close() shut the listener down
                return
            with self._lock:
                if self._is_closed:
                    sock.close()
                    return
                thread = None
                if len(self._server_socks) < self.max_num_connections:
                    # the handshake runs on the new thread: a silent client must not stall us
                    name = f"kv-tcp-serve-{self.name}"
                    thread = threading.Thread(
                        target=self._serve, args=(sock, addr), name=name, daemon=True
                    )
                    self._server_socks.add(sock)
                    self._server_threads = [t for t in self._server_threads if t.is_alive()]
                    self._server_threads.append(thread)
            if thread is None:
                self._refuse(sock, addr)
            else:
                thread.start()

    def _refuse(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        # Counted and logged before the hang-up: whoever sees the hang-up sees the count.
        self._num_refused += 1
        if self._num_refused % _LOG_REFUSAL_EVERY == 1:
            logger.warning("%s: refused a KV connection from %s:%s: %d open, the most served "
                           "at once (%d refused so far)", self.name, addr[0], addr[1],
                           self.max_num_connections, self._num_refused)  # fmt: skip
        sock.close()

    def _serve(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        try:
            who = f"{addr[0]}:{addr[1]}"
            if not admit(sock, self._secret, self.io_timeout_s, f"{who} (to {self.name})"):
                return  # nothing served; `finally` hangs up
            while self._serve_one(sock):
                pass
        except TransportError as exc:  # a bad request: tell the initiator, then hang up
            logger.warning("%s: refused a request: %s", self.name, exc)
            try:
                wire.send_reply(sock, str(exc))
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
        header = sock.recv(wire.REQUEST.size, socket.MSG_WAITALL)
        if not header:
            return False
        if len(header) < wire.REQUEST.size:
            raise ConnectionError("connection closed mid-header")
        sock.settimeout(self.io_timeout_s)
        op, name_len, num_ids, notif_len = wire.REQUEST.unpack(header)
        body = wire.recv_exact(sock, name_len + 4 * num_ids + notif_len)
        sender = body[:name_len].decode()
        block_ids = np.frombuffer(body, ">u4", num_ids, name_len).tolist()
        notif = body[name_len + 4 * num_ids :]
        if op == wire.OP_READ:
            wire.send_all(sock, [wire.REPLY.pack(0, 0), *self._served_blocks(block_ids)])
        elif op == wire.OP_WRITE:
            wire.recv_into_all(sock, self._served_blocks(block_ids))
            self._deliver(sender, notif)  # only now: the bytes are in our buffer
            wire.send_reply(sock)
        elif op == wire.OP_NOTIF:
            self._deliver(sender, notif)
            wire.send_reply(sock)
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
            if thread.ident is not None:  # started
                thread.join(timeout=2.0)

    # ---- helpers --------------------------------------------------------------------------

    def _region_or_raise(self) -> Region:
        if self._region is None or self._is_closed:
            raise TransportError(f"{self.name}: no KV buffer registered (or closed)")
        return self._region


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
