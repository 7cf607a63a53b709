"""The TCP transport's connection handshake: who may read or write our KV blocks.

Owns the handshake frames and both sides of it; tcp.py runs `admit` on every accepted
connection before serving a request, tcp_link.py runs `authenticate` on every new connection.

  server -> client  HELLO   magic, mode (0 = no secret, 1 = secret), 32-byte nonce ns
  client -> server  PROOF   nonce nc, len(name), name, digest(secret, "client", ns, nc, name)
  server -> client  ACCEPT  status (0 = ok), digest(secret, "server", ns, nc)
(PROOF and ACCEPT in mode 1 only; in mode 0 requests follow HELLO directly.)

Both sides prove they hold the cluster secret; the secret itself never goes on the wire, and
fresh nonces on both sides mean a recorded proof is useless later. The "client"/"server" labels
keep one side's proof from being reflected back as the other's. The mode byte makes a side with
a secret and a side without one fail at once instead of mis-parsing each other's frames.
Not covered: the stream after the handshake is neither encrypted nor integrity-protected, so
an on-path attacker who can rewrite packets can still hijack a connection (use a private net).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import time

from disagg.kv.transport.base import TransportError
from disagg.security.auth import digest

__all__ = ["ACCEPT", "HELLO", "PROOF", "AuthError", "admit", "authenticate"]

logger = logging.getLogger(__name__)

HELLO = struct.Struct("!4sB32s")  # magic, mode, server nonce
PROOF = struct.Struct("!32sH")  # client nonce, len(client name); the name and its MAC follow
ACCEPT = struct.Struct("!B32s")  # status (0 = ok), server MAC (zeros when refused)
MAC_NBYTES = 32
_MAGIC = b"DKVA"
MODE_OPEN, MODE_SECRET = 0, 1


class AuthError(TransportError):
    """The handshake failed: the peer does not share our secret (or our lack of one)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"authentication failed: {reason}")


def admit(sock: socket.socket, secret: str | None, timeout_s: float, who: str) -> bool:
    """Server side. True if the connecting peer may be served; else logs why (naming `who`,
    the peer's address) and the caller must close. Bounded by `timeout_s` in all, so a client
    that connects and says nothing (or dribbles bytes) cannot hold the serving thread."""
    deadline = time.monotonic() + timeout_s
    nonce = secrets.token_bytes(32)
    try:
        _send(sock, HELLO.pack(_MAGIC, MODE_SECRET if secret else MODE_OPEN, nonce), deadline)
        if secret:
            _check_client(sock, secret, nonce, deadline)
        return True
    except AuthError as exc:
        logger.warning("refused KV connection from %s: %s", who, exc)
    except OSError as exc:  # silent past the deadline, or hung up mid-handshake
        logger.warning("refused KV connection from %s: %s", who, _incomplete(exc))
    return False


def _check_client(sock: socket.socket, secret: str, ns: bytes, deadline: float) -> None:
    nc, name_len = PROOF.unpack(_recv(sock, PROOF.size, deadline))
    rest = _recv(sock, name_len + MAC_NBYTES, deadline)
    name, given = rest[:name_len], rest[name_len:]
    if not hmac.compare_digest(digest(secret, b"client", ns, nc, name), given):
        _send(sock, ACCEPT.pack(1, bytes(MAC_NBYTES)), deadline)  # so the peer can say why
        raise AuthError(f"bad proof of the shared secret (claims to be {name[:64]!r})")
    _send(sock, ACCEPT.pack(0, digest(secret, b"server", ns, nc)), deadline)


def authenticate(sock: socket.socket, secret: str | None, name: str, timeout_s: float) -> None:
    """Client side, on a fresh connection before any request. Raises AuthError."""
    deadline = time.monotonic() + timeout_s
    try:
        magic, mode, ns = HELLO.unpack(_recv(sock, HELLO.size, deadline))
        if magic != _MAGIC or mode not in (MODE_OPEN, MODE_SECRET):
            raise AuthError("the peer is not a KV TCP transport of this version")
        if mode == MODE_OPEN and secret:
            raise AuthError("the peer has no shared secret configured; we do")
        if mode == MODE_SECRET and not secret:
            raise AuthError("the peer requires a shared secret; we have none configured")
        if secret:
            _prove(sock, secret, name.encode(), ns, deadline)
    except OSError as exc:  # timeout, or the peer hung up mid-handshake
        raise _incomplete(exc) from exc


def _incomplete(exc: OSError) -> AuthError:
    return AuthError(f"handshake did not complete: {exc!r}")


def _prove(sock: socket.socket, secret: str, name: bytes, ns: bytes, deadline: float) -> None:
    nc = secrets.token_bytes(32)
    proof = digest(secret, b"client", ns, nc, name)
    _send(sock, PROOF.pack(nc, len(name)) + name + proof, deadline)
    status, given = ACCEPT.unpack(_recv(sock, ACCEPT.size, deadline))
    if status != 0:
        raise AuthError("the peer rejected our proof (different shared secret?)")
    if not hmac.compare_digest(digest(secret, b"server", ns, nc), given):
        raise AuthError("the peer did not prove it holds the shared secret")


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(data)


def _recv(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """Exactly `nbytes`, all by `deadline` (a per-recv timeout alone lets a peer dribble)."""
    data = bytearray()
    while len(data) < nbytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("handshake timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return bytes(data)
