"""The TCP transport's wire format: length-prefixed frames, scatter/gather socket I/O.

A request is (op, sender name, block ids, notification); a reply is a status and an error text,
with READ's block bytes after it. Block bytes go straight between the socket and the buffer.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import struct
from collections.abc import Sequence

import numpy as np

from disagg.kv.transport.base import TransportError

__all__ = [
    "IOV_MAX", "OP_NOTIF", "OP_READ", "OP_WRITE", "REPLY", "REQUEST", "RemoteError",
    "encode_request", "read_reply", "recv_exact", "recv_into_all", "send_all", "send_reply",
]  # fmt: skip

REQUEST = struct.Struct("!BHII")  # op, len(sender name), num block ids, len(notif)
REPLY = struct.Struct("!BI")  # status (0 = ok), len(error text); READ's block bytes follow
OP_READ, OP_WRITE, OP_NOTIF = 1, 2, 3
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class RemoteError(TransportError):
    """The peer answered a request with an error."""


def encode_request(op: int, sender: str, block_ids: Sequence[int], notif: bytes) -> bytes:
    name = sender.encode()
    ids = np.asarray(block_ids, dtype=">u4").tobytes()
    return REQUEST.pack(op, len(name), len(block_ids), len(notif)) + name + ids + notif


def advance(pending: collections.deque[memoryview], nbytes: int) -> None:
    """Drop `nbytes` from the front of a queue of buffers (after a partial send/receive)."""
    while nbytes:
        head = pending[0]
        if nbytes >= len(head):
            nbytes -= len(head)
            pending.popleft()
        else:
            pending[0] = head[nbytes:]
            nbytes = 0


def send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send every buffer, gathering up to IOV_MAX of them per syscall."""
    pending = collections.deque(memoryview(b).cast("B") for b in buffers)
    while pending:
        advance(pending, sock.sendmsg(list(itertools.islice(pending, IOV_MAX))))


def recv_into_all(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view from the socket, scattering up to IOV_MAX of them per syscall."""
    pending = collections.deque(views)
    while pending:
        nbytes = sock.recvmsg_into(list(itertools.islice(pending, IOV_MAX)))[0]
        if nbytes == 0:
            raise ConnectionError("connection closed mid-frame")
        advance(pending, nbytes)


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    if nbytes:
        recv_into_all(sock, [memoryview(data)])
    return bytes(data)


def send_reply(sock: socket.socket, error: str = "") -> None:
    text = error.encode()
    sock.sendall(REPLY.pack(1 if error else 0, len(text)) + text)


def read_reply(sock: socket.socket) -> None:
    status, text_len = REPLY.unpack(recv_exact(sock, REPLY.size))
    if status:
        raise RemoteError(recv_exact(sock, text_len).decode(errors="replace"))
