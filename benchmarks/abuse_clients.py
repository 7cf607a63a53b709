"""abuse_bench.py's clients beside the attacks: one HTTP call that never raises, the victim
streaming greedy completions through the router, and the /health poller of P and D.

Each records what it saw (lists only appended to) on its own thread; judging is the bench's.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time

from soak_http import JSON_HEADERS, connect

HEALTH_EVERY_S = 0.05  # between two /health probes (P and D in turn)
TIMEOUT_S = 60.0  # any one HTTP call, the victim's streams included
VICTIM_PROMPT = [101, 202, 303, 404, 505, 606, 707, 808]


def request(
    url: str,
    method: str,
    path: str,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, float]:
    """(status, body, seconds to the whole answer); status 0 when the connection failed."""
    started = time.monotonic()
    conn = connect(url, TIMEOUT_S)
    try:
        conn.request(method, path, body=data, headers={**JSON_HEADERS, **(headers or {})})
        resp = conn.getresponse()
        status, raw = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        status, raw = 0, repr(exc).encode()
    finally:
        conn.close()
    return status, raw, time.monotonic() - started


def error_message(raw: bytes) -> str:
    """The message of an OpenAI-shaped error, else the answer's first bytes."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        return str(json.loads(raw)["error"]["message"])[:120]
    return repr(raw[:120])


class Victim:
    """Greedy streams through the router, one after another, on a thread: when each text chunk
    arrived (stream index, monotonic s) and any error. Lists are only appended to."""

    def __init__(self, url: str, max_tokens: int) -> None:
        body = {"prompt": VICTIM_PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        self.url, self.data = url, json.dumps(body).encode()
        self.chunk_times: list[tuple[int, float]] = []
        self.errors: list[str] = []
        self.num_streams = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while len(self.chunk_times) < 8 and time.monotonic() < deadline and not self.errors:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(TIMEOUT_S)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._stream(self.num_streams)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self.errors.append(f"stream {self.num_streams}: {exc!r}")
                time.sleep(0.1)
            self.num_streams += 1

    def _stream(self, index: int) -> None:
        conn = connect(self.url, TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", self.data, JSON_HEADERS)
            resp = conn.getresponse()
            if resp.status != 200:
                self.errors.append(f"stream {index}: HTTP {resp.status}: {resp.read()[:120]!r}")
                return
            while line := resp.readline():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    event = json.loads(line[5:])
                    if "error" in event:
                        self.errors.append(f"stream {index}: {event['error']}")
                    elif event.get("choices"):
                        self.chunk_times.append((index, time.monotonic()))
        finally:
            conn.close()


class HealthPoller:
    """GET /health of each target in turn every HEALTH_EVERY_S, on a thread."""

    def __init__(self, targets: dict[str, str]) -> None:
        self.targets = targets
        self.samples: list[tuple[str, float, float, int]] = []  # name, started s, latency s, status
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(TIMEOUT_S)

    def _run(self) -> None:
        while not self._stopping.is_set():
            for name, url in self.targets.items():
                started = time.monotonic()
                status, _, latency_s = request(url, "GET", "/health")
                self.samples.append((name, started, latency_s, status))
                self._stopping.wait(HEALTH_EVERY_S)
