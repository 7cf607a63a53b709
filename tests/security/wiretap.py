"""An attacker's view of internal HTTP: a TCP relay that forwards every byte unchanged and
keeps a copy of what clients sent, split into the HTTP requests it carried, so a test can
send a recorded request again byte for byte (a replay).

Owns one listening socket and two threads per relayed connection; `close()` stops it. No
parsing beyond what splitting requests needs (headers, Content-Length).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from dataclasses import dataclass

__all__ = ["Recorded", "Wiretap", "send_raw"]

_CHUNK_BYTES = 65536


@dataclass(frozen=True, slots=True)
class Recorded:
    """One HTTP request as it went over the wire."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    raw: bytes  # request line, headers and body, exactly as sent

    @property
    def body(self) -> bytes:
        return self.raw.split(b"\r\n\r\n", 1)[1]


class Wiretap:
    """Listens on `listen` and relays each connection to `upstream` (settable after start:
    the tapped server may need the tap's address before it can start)."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int] | None = None) -> None:
        self.upstream = upstream
        self._server = socket.create_server(listen)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._streams: list[bytearray] = []  # client -> server bytes, one per connection
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="wiretap", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def requests(self, path: str | None = None) -> list[Recorded]:
        """Every complete request seen so far (only those to `path` when given), in order."""
        with self._lock:
            streams = [bytes(s) for s in self._streams]
        found = [r for stream in streams for r in _split(stream)]
        return [r for r in found if path is None or r.path == path]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            assert self.upstream is not None, "wiretap: set upstream before traffic arrives"
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the tapped server is gone (teardown): hang up on the client
                client.close()
                continue
            stream = bytearray()
            with self._lock:
                self._streams.append(stream)
            threading.Thread(target=self._pump, args=(client, server, stream), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while data := src.recv(_CHUNK_BYTES):
                if record is not None:
                    with self._lock:
                        record.extend(data)
                dst.sendall(data)
        except OSError:
            pass  # either side hung up: the relay of this connection ends
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


def _split(stream: bytes) -> list[Recorded]:
    """The requests in one connection's client bytes (bodies by Content-Length)."""
    found: list[Recorded] = []
    while b"\r\n\r\n" in stream:
        head, rest = stream.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = dict(line.split(": ", 1) for line in lines[1:])
        headers = {k.lower(): v for k, v in headers.items()}
        size = int(headers.get("content-length", "0"))
        if len(rest) < size:
            break  # still arriving
        found.append(Recorded(method, path, headers, head + b"\r\n\r\n" + rest[:size]))
        stream = rest[size:]
    return found


def send_raw(address: tuple[str, int], raw: bytes, timeout_s: float = 60.0) -> tuple[int, bytes]:
    """Send recorded request bytes on a fresh connection; the answer's status and body."""
    with socket.create_connection(address, timeout=timeout_s) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()
