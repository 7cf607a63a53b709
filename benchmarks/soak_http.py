"""The soak's HTTP client calls, on plain http.client: one request, one streamed completion,
a hang-up, and reading an OpenAI-shaped error. abuse_clients.py connects through `connect`
too.

Knows nothing of the soak's counters or checks: callers judge what comes back.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from typing import Any

JSON_HEADERS = {"Content-Type": "application/json"}
PATH = "/v1/completions"


def connect(url: str, timeout_s: float) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout_s)


def request(
    url: str,
    method: str,
    path: str,
    data: bytes | None = None,
    *,
    timeout_s: float,
    headers: dict[str, Any] | None = None,
) -> tuple[int, bytes]:
    conn = connect(url, timeout_s)
    try:
        conn.request(method, path, body=data, headers={**JSON_HEADERS, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def error_message(parsed: Any) -> str | None:
    """The message of an OpenAI-shaped error ({"error": {"message": str}}), else None."""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else None


def stream(
    url: str, body: dict[str, Any], timeout_s: float, headers: dict[str, str]
) -> tuple[int, list[Any]]:
    """A streamed completion -> (status, SSE payloads with "[DONE]"); TimeoutError past the
    deadline."""
    deadline, conn = time.monotonic() + timeout_s, connect(url, timeout_s)
    try:
        conn.request(
            "POST", PATH, json.dumps({**body, "stream": True}), {**JSON_HEADERS, **headers}
        )
        resp = conn.getresponse()
        if not resp.getheader("Content-Type", "").startswith("text/event-stream"):
            return resp.status, [loads(resp.read())]
        events: list[Any] = []
        while line := resp.readline():
            if time.monotonic() > deadline:
                raise TimeoutError("stream past its deadline")
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else loads(payload))
        return resp.status, events
    finally:
        conn.close()


def hang_up(conn: http.client.HTTPConnection) -> None:
    """Close both directions at once, as a client that goes away does."""
    with contextlib.suppress(OSError):
        if conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
