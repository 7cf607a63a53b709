"""A small HTTP client for the end-to-end tests: seeded prompts, completion bodies, plain and
streamed /v1/completions, and the cluster-signed calls the router would send.

Talks to whatever URL it is given; owns no process (tests/e2e/cluster.py starts them). Never
imports torch.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from disagg.security import auth

__all__ = [
    "CLUSTER_TOKEN",
    "Answer",
    "OpenStream",
    "Stream",
    "complete",
    "completion_body",
    "http_request",
    "open_stream",
    "prompt_ids",
    "read_chunks",
    "run_all",
    "stream",
]

REQUEST_TIMEOUT_S = 60.0  # the longest silence a test client accepts before calling it a hang
_JSON_HEADERS = {"Content-Type": "application/json"}
# The cluster secret every child gets (in its environment, as `disagg up` hands it over).
CLUSTER_TOKEN = "e2e-cluster-token-not-a-secret"


# ---- requests --------------------------------------------------------------------------------


def http_request(
    url: str,
    method: str,
    path: str,
    body: Any,
    *,
    timeout_s: float,
    signed: bool = False,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    conn = connect(url, timeout_s, context)
    try:
        data = None if body is None else json.dumps(body).encode()
        extra = headers or {}
        request_id = extra.get("X-Request-Id", "")
        all_headers = {**_headers(method, url + path, data, signed, request_id), **extra}
        conn.request(method, path, body=data, headers=all_headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _headers(
    method: str, url: str, data: bytes | None, signed: bool, request_id: str
) -> dict[str, str]:
    """JSON headers; `signed`: as the router sends a leg (a cluster call, for `url`, once)."""
    if not signed:
        return _JSON_HEADERS
    signature = auth.sign(CLUSTER_TOKEN, method, url, data or b"", request_id=request_id)
    return {**_JSON_HEADERS, auth.SIGNATURE_HEADER: signature.header}


def connect(
    url: str, timeout_s: float, context: ssl.SSLContext | None = None
) -> http.client.HTTPConnection:
    scheme, _, address = url.partition("://")
    host, port = address.rsplit(":", 1)
    if scheme == "https":
        return http.client.HTTPSConnection(host, int(port), timeout=timeout_s, context=context)
    return http.client.HTTPConnection(host, int(port), timeout=timeout_s)


# ---- client ----------------------------------------------------------------------------------


def prompt_ids(seed: int, num_tokens: int, vocab_size: int = 2048) -> list[int]:
    """A seeded prompt of ordinary token ids (ids 0-2 are the tiny tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def completion_body(prompt_ids: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy /v1/completions body over token ids that never stops early."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {**body, **extra}


@dataclass(slots=True)
class Answer:
    """A non-streamed answer: HTTP status and the JSON body (None if it was not JSON)."""

    status: int
    body: Any
    elapsed_s: float

    @property
    def text(self) -> str:
        assert self.status == 200, f"HTTP {self.status}: {self.body}"
        return self.body["choices"][0]["text"]

    @property
    def error_message(self) -> str:
        try:
            return str(self.body["error"]["message"])
        except (KeyError, TypeError):
            return repr(self.body)


def complete(
    url: str,
    body: dict[str, Any],
    *,
    timeout_s: float = REQUEST_TIMEOUT_S,
    signed: bool = False,
    headers: dict[str, str] | None = None,
) -> Answer:
    """POST /v1/completions (non-streamed); a silence longer than timeout_s raises. `signed`
    sends it as a cluster call (how the router sends legs with kv_transfer_params)."""
    started = time.monotonic()
    status, raw = http_request(
        url, "POST", "/v1/completions", body, timeout_s=timeout_s, signed=signed, headers=headers
    )
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    return Answer(status, parsed, time.monotonic() - started)


@dataclass(slots=True)
class Stream:
    """A streamed answer: the SSE events in order ("[DONE]" kept as a string)."""

    status: int
    events: list[Any] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if _is_chunk(e))

    @property
    def finish_reason(self) -> str | None:
        reasons = [e["choices"][0].get("finish_reason") for e in self.events if _is_chunk(e)]
        return next((r for r in reversed(reasons) if r), None)

    @property
    def error(self) -> str | None:
        for event in self.events:
            if isinstance(event, dict) and "error" in event:
                return str(event["error"].get("message"))
        return None

    @property
    def is_done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


def _is_chunk(event: Any) -> bool:
    return isinstance(event, dict) and bool(event.get("choices"))


class OpenStream:
    """A streamed request, sent at once; its answer is read lazily, one event at a time, and
    `close()` hangs up at any point (before the headers or mid-stream)."""

    def __init__(self, url: str, body: dict[str, Any], timeout_s: float) -> None:
        self._conn = connect(url, timeout_s)
        payload = json.dumps({**body, "stream": True})
        self._conn.request("POST", "/v1/completions", payload, _JSON_HEADERS)
        self._sock = self._conn.sock  # kept: http.client may hand it to the response
        self._resp: http.client.HTTPResponse | None = None

    @property
    def resp(self) -> http.client.HTTPResponse:
        if self._resp is None:
            self._resp = self._conn.getresponse()
        return self._resp

    @property
    def status(self) -> int:
        return self.resp.status

    def events(self) -> Iterator[Any]:
        """SSE `data:` payloads as they arrive (JSON, or "[DONE]"); a non-SSE body is one event."""
        if self.resp.getheader("Content-Type", "").split(";")[0] != "text/event-stream":
            raw = self.resp.read()
            yield json.loads(raw) if raw else None
            return
        while line := self.resp.readline():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line.removeprefix(b"data:").strip()
            yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)

    def close(self) -> None:
        """Hang up now: the server sees the connection end even if references linger."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._resp is not None:
            self._resp.close()
        self._conn.close()


def open_stream(
    url: str, body: dict[str, Any], *, timeout_s: float = REQUEST_TIMEOUT_S
) -> OpenStream:
    return OpenStream(url, body, timeout_s)


def stream(url: str, body: dict[str, Any], *, timeout_s: float = REQUEST_TIMEOUT_S) -> Stream:
    """POST /v1/completions with stream=true and read every event."""
    started = time.monotonic()
    opened = open_stream(url, body, timeout_s=timeout_s)
    try:
        events = list(opened.events())
    finally:
        opened.close()
    return Stream(opened.status, events, time.monotonic() - started)


def read_chunks(opened: OpenStream, num_chunks: int) -> None:
    """Read until `num_chunks` text chunks arrived (the request is decoding)."""
    events = opened.events()
    for _ in range(num_chunks):
        event = next(events)
        assert _is_chunk(event), f"expected a text chunk, got {event!r}"


def run_all(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """fn over items, all at once (one thread each): concurrent clients."""
    with ThreadPoolExecutor(max(1, len(items))) as pool:
        return list(pool.map(fn, items))
