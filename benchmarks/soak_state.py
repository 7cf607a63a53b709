"""The running soak's state: its children by name, the outcome counters (thread-safe), RSS
samples and the reference texts; and `greedy`, the one request whose text every check compares
with the aggregated reference instance.

Counts what callers report; which action to take and what is wrong are soak_load.py's and
soak_checks.py's.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import threading
from collections import Counter
from typing import Any

from soak_cluster import API_KEY, Child
from soak_http import PATH, error_message, loads, request, stream
from soak_inputs import BAD_INPUTS, SPECIAL_INPUTS

COUNTS = ("sent", "succeeded", "failed_with_error", "rejected_ok", "bad_input_misanswered",
          "hung", "wrong_token_200", "disconnects", "early_hangups")  # fmt: skip
DETAILS = ("rejected_by_input", "error_messages", "misanswered_inputs", "hung_actions")


class Soak:
    """The running soak: children, counters (thread-safe), RSS samples and reference texts."""

    def __init__(
        self, children: list[Child], vocab_size: int, timeout_s: float, token: str
    ) -> None:
        self.children = {child.name: child for child in children}
        self.routers = [self.children["router-push"].url, self.children["router-pull"].url]
        self.vocab_size, self.timeout_s, self.token = vocab_size, timeout_s, token
        self.counts: Counter[str] = Counter()
        self.details = {kind: Counter[str]() for kind in DETAILS}
        self.wrong: list[dict[str, Any]] = []
        self.killed: dict[str, Any] = {}
        self.rss_mib: dict[str, list[float]] = {child.name: [] for child in children}
        self._refs: dict[str, str] = {}
        self._lock = threading.Lock()
        self._num_bad = 0

    def count(self, what: str, kind: str = "", detail: str = "") -> None:
        """Count an outcome; `detail` (URLs and ids masked) under details[kind]."""
        detail = re.sub(r"http://[\w.:\-]+", "http://...", detail)
        with self._lock:
            self.counts[what] += 1
            if kind:
                self.details[kind][re.sub(r"[0-9a-f]{12,}", "...", detail)[:200]] += 1

    def headers(self, url: str) -> dict[str, str]:
        """What a client sends to `url`: router-push wants the API key."""
        is_push = url == self.children["router-push"].url
        return {"Authorization": f"Bearer {API_KEY}"} if is_push else {}

    def reference(self, body: dict[str, Any]) -> str:
        """The aggregated instance's text for this body (asked once per body, not counted)."""
        key = json.dumps(body, sort_keys=True)
        if key not in self._refs:
            url = self.children["reference"].url
            status, raw = request(url, "POST", PATH, key.encode(), timeout_s=self.timeout_s)
            if status != 200:
                raise RuntimeError(f"reference instance: HTTP {status}: {raw[:200]!r}")
            self._refs[key] = json.loads(raw)["choices"][0]["text"]
        return self._refs[key]

    def body(self, rng: random.Random) -> dict[str, Any]:
        """A greedy token-id body; 64 prompt seeds, so prefixes repeat (prefix cache hits)."""
        prompt_rng = random.Random(rng.randrange(64))
        prompt = [prompt_rng.randrange(3, self.vocab_size) for _ in range(200)]
        prompt, max_tokens = prompt[: rng.randint(16, 200)], rng.randint(4, 16)
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def next_bad(self) -> str:
        """The next bad input's name, in rotation over BAD_INPUTS and SPECIAL_INPUTS."""
        names = [name for name, _ in BAD_INPUTS] + list(SPECIAL_INPUTS)
        with self._lock:
            self._num_bad += 1
            return names[self._num_bad % len(names)]

    def add_wrong(self, record: dict[str, Any]) -> None:
        """Keep a 200 whose text was not the reference's (the report shows the first three)."""
        with self._lock:
            self.wrong.append(record)

    def sample_rss(self) -> None:
        for name, child in self.children.items():
            with contextlib.suppress(OSError, KeyError, ValueError):  # it may just have died
                if child.alive:
                    self.rss_mib[name].append(child.rss_mib())


def greedy(
    soak: Soak,
    url: str,
    body: dict[str, Any],
    streamed: bool,
    headers: dict[str, Any] | None = None,
) -> tuple[str, int, str]:
    """One greedy request -> (outcome, HTTP status, error message). `headers` replace the
    client's usual ones (soak.headers)."""
    headers = soak.headers(url) if headers is None else headers
    if streamed:
        status, events = stream(url, body, soak.timeout_s, headers)
        errors = [m for m in map(error_message, events) if m]
        if status != 200 or errors or events[-1:] != ["[DONE]"]:
            return "failed_with_error", status, errors[0] if errors else f"stream, HTTP {status}"
        text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))
    else:
        data = json.dumps(body).encode()
        status, raw = request(url, "POST", PATH, data, timeout_s=soak.timeout_s, headers=headers)
        if status != 200:
            return "failed_with_error", status, error_message(loads(raw)) or f"HTTP {status}"
        text = json.loads(raw)["choices"][0]["text"]
    reference = soak.reference({**body, "temperature": 0})
    if text == reference:
        return "succeeded", status, ""
    soak.add_wrong({"url": url, "body": body, "text": text, "reference": reference})
    return "wrong_token_200", status, ""
