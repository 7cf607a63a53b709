"""A bounded mixed soak: real push and pull clusters under good, cancelled and bad requests.

Starts, all on 127.0.0.1 (port 0, one torch thread each, every child dies with this process):
an aggregated reference instance; a push cluster (prefill + 2 decode, one with policy
recompute) and a pull cluster (prefill + 3 decode: plain, recompute with `--kv-fault
fail_transfer`, and fail_transfer with policy fail), each behind `disagg route`. Then
--concurrency client threads loop for --duration-s, each picking at random: a greedy completion
(token-id prompt, streamed or not, via either router) whose 200 must match the reference
instance's text; a client that hangs up mid-stream; or a bad input (a rotating list) that must
get a 4xx in the OpenAI error shape (or, for the odd-but-valid ones, be served with the
reference text); or a client that hangs up before the first byte (in pull mode: during the
prefill leg or the handoff to decode). Bad inputs include a huge prompt and a huge stop list,
a request id reused right after its client hung up, a replayed signed internal call, odd
Authorization headers (router-push asks for an API key, handed over in its environment) and
top_p=1e-300. Once, in the middle third, a push decode instance is SIGKILLed. Every request
has a client deadline; passing it counts as hung. Every child's RSS is sampled every few
seconds during the load (first after warm-up / peak / at half time / last). At the end: the
counts, each surviving instance's pool after a settle wait, and RSS / threads / open fds of
every surviving child after warm-up and at the end. Prints a table; the last stdout line is the
JSON document (also written to --out). Exit status 1 if anything hung, a 200 had wrong text, a
bad input was misanswered, a child died unasked, a pool was not full again, or a child's RSS
grew by more than RSS_GROWTH_MIB over the second half of the load (a leak, not a warm-up).

    python benchmarks/soak.py [--duration-s 600] [--model DIR] [--concurrency 4] [--seed 0]
                              [--client-timeout-s 60] [--transport tcp|nixl]
                              [--out docs/results/soak.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import random
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0  # eight cold starts import torch at once on two cores
SETTLE_S = 30.0  # pools must be full again within this after the load stops
ROUTER_MAX_BYTES = 256 * 1024  # the routers' body limit; "huge body" goes past it
RSS_EVERY_S = 5.0  # between RSS samples of every child during the load
RSS_GROWTH_MIB = 64.0  # more than this from half time to the end of the load: growing
API_KEY = "soak-" + secrets.token_urlsafe(16)  # router-push's, from $DISAGG_API_KEY
COUNTS = ("sent", "succeeded", "failed_with_error", "rejected_ok", "bad_input_misanswered",
          "hung", "wrong_token_200", "disconnects", "early_hangups")  # fmt: skip
DETAILS = ("rejected_by_input", "error_messages", "misanswered_inputs", "hung_actions")
KV_STATS = ("transfers", "transfers_failed", "expired_leases", "expired_reservations")
_READY = re.compile(rb"ready on (http://[\w.\-]+:\d+)")
_JSON = {"Content-Type": "application/json"}
PATH = "/v1/completions"
_TINY = ["--arch", "qwen3", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
         "--intermediate", "128", "--vocab", "2048", "--seed", "1"]  # fmt: skip
RECOMPUTE, FAULT = ("--failure-policy", "recompute"), ("--kv-fault", "fail_transfer")
PLAN = [  # name, role, connector, extra flags
    ("reference", "both", "", ()),
    ("push-prefill", "prefill", "push", ()),
    ("push-decode-0", "decode", "push", ()),  # killed in the middle third
    ("push-decode-1", "decode", "push", RECOMPUTE),
    ("pull-prefill", "prefill", "pull", ()),
    ("pull-decode-0", "decode", "pull", ()),
    ("pull-decode-1", "decode", "pull", RECOMPUTE + FAULT),  # always recomputes
    ("pull-decode-2", "decode", "pull", FAULT),  # always fails, with an error
]
VICTIM = "push-decode-0"


# ---- children --------------------------------------------------------------------------------


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class Child:
    """A `disagg serve` / `disagg route` child on a free port, logging to a file."""

    def __init__(
        self, name: str, args: list[str], log_dir: Path, token: str, api_key: str = ""
    ) -> None:
        self.name, self.url, self.log_path = name, "", log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["DISAGG_CLUSTER_TOKEN"] = token  # the cluster secret, as `disagg up` hands it over
        env.pop("DISAGG_API_KEY", None)
        if api_key:
            env["DISAGG_API_KEY"] = api_key  # never on the command line
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "disagg.cli", *args], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent,
            )  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, deadline: float) -> None:
        while not self._is_ready():
            if not self.alive or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} did not start:\n{tail}")
            time.sleep(0.2)

    def _is_ready(self) -> bool:
        found = _READY.search(self.log_path.read_bytes())
        if found:
            self.url = found.group(1).decode()
            with contextlib.suppress(OSError):
                return _request(self.url, "GET", "/health", timeout_s=2)[0] == 200
        return False

    def proc_stats(self) -> dict[str, float]:
        """RSS (MiB), threads and open file descriptors, from /proc."""
        fds = len(os.listdir(f"/proc/{self.popen.pid}/fd"))
        return {"rss_mib": self.rss_mib(), "threads": int(self._status()["Threads"]), "fds": fds}

    def rss_mib(self) -> float:
        return round(int(self._status()["VmRSS"].split()[0]) / 1024, 1)

    def _status(self) -> dict[str, str]:
        lines = Path(f"/proc/{self.popen.pid}/status").read_text().splitlines()
        return dict(line.split(":", 1) for line in lines)


def _start(
    model_dir: Path, args: argparse.Namespace, log_dir: Path, started: list[Child], token: str
) -> None:
    """Every instance of PLAN, then the two routers, all ready; each appended to `started`."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for name, role, connector, extra in PLAN:
        argv = ["serve", "--model", str(model_dir), "--host", HOST, "--port", "0"]
        # fp32: "wrong text" compares tokens with the reference, and in bf16 (the default where
        # the CPU has it) two batch compositions round differently, so a busy machine would
        # report batching as corruption.
        argv += ["--num-threads", "1", "--role", role, "--dtype", "float32", *extra]
        if role != "both":
            argv += ["--kv-connector", connector, "--kv-transport", args.transport]
            argv += ["--kv-host", HOST]
        started.append(Child(name, argv, log_dir, token))
    for child in started:
        child.wait_ready(deadline)
    urls = {child.name: child.url for child in started}
    for mode in ("push", "pull"):
        argv = ["route", "--host", HOST, "--port", "0", "--mode", mode]
        argv += ["--max-request-bytes", str(ROUTER_MAX_BYTES), "--prefill", urls[f"{mode}-prefill"]]
        argv += ["--decode", *(url for n, url in urls.items() if n.startswith(f"{mode}-decode"))]
        api_key = API_KEY if mode == "push" else ""  # odd Authorization headers meet a key
        started.append(Child(f"router-{mode}", argv, log_dir, token, api_key))
        started[-1].wait_ready(deadline)


def _stop(children: list[Child]) -> None:
    """Routers first, then instances: SIGTERM to all, wait, SIGKILL what is left."""
    for child in reversed(children):
        if child.alive:
            child.popen.terminate()
    for child in reversed(children):
        try:
            child.popen.wait(10)
        except subprocess.TimeoutExpired:
            child.popen.kill()
            child.popen.wait(5)


# ---- HTTP ------------------------------------------------------------------------------------


def _connect(url: str, timeout_s: float) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout_s)


def _request(
    url: str,
    method: str,
    path: str,
    data: bytes | None = None,
    *,
    timeout_s: float,
    headers: dict[str, Any] | None = None,
) -> tuple[int, bytes]:
    conn = _connect(url, timeout_s)
    try:
        conn.request(method, path, body=data, headers={**_JSON, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _error_message(parsed: Any) -> str | None:
    """The message of an OpenAI-shaped error ({"error": {"message": str}}), else None."""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else None


def _stream(
    url: str, body: dict[str, Any], timeout_s: float, headers: dict[str, str]
) -> tuple[int, list[Any]]:
    """A streamed completion -> (status, SSE payloads with "[DONE]"); TimeoutError past the
    deadline."""
    deadline, conn = time.monotonic() + timeout_s, _connect(url, timeout_s)
    try:
        conn.request("POST", PATH, json.dumps({**body, "stream": True}), {**_JSON, **headers})
        resp = conn.getresponse()
        if not resp.getheader("Content-Type", "").startswith("text/event-stream"):
            return resp.status, [_loads(resp.read())]
        events: list[Any] = []
        while line := resp.readline():
            if time.monotonic() > deadline:
                raise TimeoutError("stream past its deadline")
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else _loads(payload))
        return resp.status, events
    finally:
        conn.close()


# ---- load ------------------------------------------------------------------------------------

_P = '"prompt": [11, 12, 13, 14], "max_tokens": 2'
BAD_INPUTS: list[tuple[str, bytes]] = [  # each must get a 4xx in the OpenAI error shape
    ("invalid json", b'{"prompt": [1, 2'),
    ("lone surrogate", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("10k-deep nesting", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
    ("temperature 1e309", ("{" + _P + ', "temperature": 1e309}').encode()),
    ("negative max_tokens", b'{"prompt": [11, 12], "max_tokens": -1}'),
    ("client kv_transfer_params", ("{" + _P + ', "kv_transfer_params": {}}').encode()),
    ("kv_transfer_params to an instance", ("{" + _P + ', "kv_transfer_params": {}}').encode()),
    ("unknown model", ("{" + _P + ', "model": "no-such-model"}').encode()),
    ("huge body", json.dumps({"prompt": [7] * (ROUTER_MAX_BYTES // 2)}).encode()),
    # Under the routers' body limit, ~60 times the instances' max_model_len in characters.
    ("huge prompt", json.dumps({"prompt": "hello " * 40_000, "max_tokens": 2}).encode()),
    ("huge stop list", json.dumps({"prompt": [11, 12, 13, 14], "max_tokens": 2,
                                   "stop": [f"stop {i}" for i in range(10_000)]}).encode()),
]  # fmt: skip
# Odd or valid inputs, and refusals that take more than one call: each has its own check below.
SPECIAL_INPUTS = ("temperature 1e-38", "top_p 1e-300", "odd Authorization",
                  "reused request id after hang-up", "replayed signed call")  # fmt: skip
ODD_AUTHORIZATIONS = [  # to router-push (which has a key): 401; to router-pull (none): served
    b"Bearer " + b"\xff\xfe" * 64,  # not UTF-8
    b"Bearer " + b"k" * 8000,  # long, still under the HTTP parser's field limit
    b"Bearer",  # a scheme and no key
    b"Basic c29hazpzb2Fr",  # another scheme
    b"Bearer " + API_KEY.encode() + b" and more",  # the key with something after it
]


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
            status, raw = _request(url, "POST", PATH, key.encode(), timeout_s=self.timeout_s)
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

    def sample_rss(self) -> None:
        for name, child in self.children.items():
            with contextlib.suppress(OSError, KeyError, ValueError):  # it may just have died
                if child.alive:
                    self.rss_mib[name].append(child.rss_mib())


def _greedy(
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
        status, events = _stream(url, body, soak.timeout_s, headers)
        errors = [m for m in map(_error_message, events) if m]
        if status != 200 or errors or events[-1:] != ["[DONE]"]:
            return "failed_with_error", status, errors[0] if errors else f"stream, HTTP {status}"
        text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))
    else:
        data = json.dumps(body).encode()
        status, raw = _request(url, "POST", PATH, data, timeout_s=soak.timeout_s, headers=headers)
        if status != 200:
            return "failed_with_error", status, _error_message(_loads(raw)) or f"HTTP {status}"
        text = json.loads(raw)["choices"][0]["text"]
    reference = soak.reference({**body, "temperature": 0})
    if text == reference:
        return "succeeded", status, ""
    with soak._lock:
        soak.wrong.append({"url": url, "body": body, "text": text, "reference": reference})
    return "wrong_token_200", status, ""


def act_greedy(soak: Soak, rng: random.Random) -> None:
    url, streamed = rng.choice(soak.routers), rng.random() < 0.5
    outcome, _, message = _greedy(soak, url, soak.body(rng), streamed)
    soak.count(outcome, "error_messages" if message else "", message)


def _hang_up(conn: http.client.HTTPConnection) -> None:
    with contextlib.suppress(OSError):
        if conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def act_disconnect(soak: Soak, rng: random.Random) -> None:
    """Open a stream, read 1-2 chunks, hang up."""
    url = rng.choice(soak.routers)
    conn = _connect(url, soak.timeout_s)
    body = json.dumps({**soak.body(rng), "max_tokens": 64, "stream": True})
    try:
        conn.request("POST", PATH, body, {**_JSON, **soak.headers(url)})
        resp, wanted = conn.getresponse(), rng.randint(1, 2)
        while wanted and (line := resp.readline()):
            wanted -= line.startswith(b"data:")
    finally:
        _hang_up(conn)
    soak.count("disconnects")


def act_early_hangup(soak: Soak, rng: random.Random) -> None:
    """Send a request (streamed or not) and hang up within 50 ms, before any answer: in pull
    mode during the prefill leg or at the handoff to decode, in push mode while both legs run.
    The pools-full check at the end says whether every leg let go of its blocks."""
    url = rng.choice(soak.routers)
    conn = _connect(url, soak.timeout_s)
    body = json.dumps({**soak.body(rng), "stream": rng.random() < 0.5})
    try:
        conn.request("POST", PATH, body, {**_JSON, **soak.headers(url)})
        time.sleep(rng.uniform(0.0, 0.05))
    finally:
        _hang_up(conn)
    soak.count("early_hangups")


def _served_as_greedy(soak: Soak, rng: random.Random, name: str, extra: dict[str, Any]) -> None:
    """A valid request that must be served with the greedy reference text: a 4xx is wrong."""
    url, body = rng.choice(soak.routers), {**soak.body(rng), **extra}
    outcome, status, message = _greedy(soak, url, body, False)
    if 400 <= status < 500:
        outcome, message = "bad_input_misanswered", f"{name}: HTTP {status}: {message}"
    kind = "misanswered_inputs" if 400 <= status < 500 else "error_messages"
    soak.count(outcome, kind if message else "", message)


def _refused(soak: Soak, name: str, status: int, answer: bytes) -> None:
    """Count a bad input's answer: right when a 4xx in the OpenAI error shape."""
    if 400 <= status < 500 and _error_message(_loads(answer)):
        return soak.count("rejected_ok", "rejected_by_input", f"{name}: HTTP {status}")
    detail = f"{name}: HTTP {status}: {answer[:120]!r}"
    soak.count("bad_input_misanswered", "misanswered_inputs", detail)


def _odd_authorization(soak: Soak, rng: random.Random, name: str) -> None:
    url, value = rng.choice(soak.routers), rng.choice(ODD_AUTHORIZATIONS)
    if soak.headers(url):  # router-push: refused as any wrong key
        data, headers = json.dumps(soak.body(rng)).encode(), {"Authorization": value}
        status, answer = _request(
            url, "POST", PATH, data, timeout_s=soak.timeout_s, headers=headers
        )
        ok = status == 401 and _error_message(_loads(answer))
        return _refused(soak, name, status if ok else 0, answer)
    # No key asked for: the header is nobody's business, so the request fares as any other
    # (an injected transfer failure included); only a refusal is wrong.
    outcome, status, message = _greedy(soak, url, soak.body(rng), False, {"Authorization": value})
    if 400 <= status < 500:
        outcome, message = "bad_input_misanswered", f"{name}: HTTP {status}: {message}"
    kind = "misanswered_inputs" if 400 <= status < 500 else "error_messages"
    soak.count(outcome, kind if message else "", message)


def _reused_request_id(soak: Soak, rng: random.Random, name: str) -> None:
    """A client's X-Request-Id (an instance keys the engine request by it), reused the moment
    its stream was hung up on: served with the right text, or refused with a 4xx while the
    first is still being aborted; never another request's tokens, a 5xx or a hang."""
    url, body = soak.children["reference"].url, soak.body(rng)
    headers = {"X-Request-Id": f"soak-reused-{rng.randrange(1 << 30)}"}
    conn = _connect(url, soak.timeout_s)
    try:
        stream = json.dumps({**body, "max_tokens": 64, "stream": True})
        conn.request("POST", PATH, stream, {**_JSON, **headers})
        conn.getresponse().readline()  # the first event: the engine holds the id
    finally:
        _hang_up(conn)
    outcome, status, message = _greedy(soak, url, body, False, headers)
    if 400 <= status < 500 and message:
        return soak.count("rejected_ok", "rejected_by_input", f"{name}: HTTP {status}")
    if outcome != "succeeded":
        outcome, message = "bad_input_misanswered", f"{name}: HTTP {status}: {message}"
    soak.count(outcome, "misanswered_inputs" if message else "", message)


def _replayed_signed_call(soak: Soak, rng: random.Random, name: str) -> None:
    """An internal call signed with the cluster token (an abort, as the router sends), sent
    twice as recorded: the first is served, the replay must be refused."""
    from disagg.security import auth  # signed as the router signs its legs

    url = soak.children["pull-decode-0"].url
    data = json.dumps({"request_id": f"soak-replay-{rng.randrange(1 << 30)}"}).encode()
    headers = auth.json_headers(soak.token, f"{url}/v1/abort", data)
    first, _ = _request(url, "POST", "/v1/abort", data, timeout_s=soak.timeout_s, headers=headers)
    status, answer = _request(
        url, "POST", "/v1/abort", data, timeout_s=soak.timeout_s, headers=headers
    )
    _refused(soak, f"{name} (first HTTP {first})", status if first == 200 else 0, answer)


SPECIAL_CHECKS = {
    "temperature 1e-38": lambda s, r, n: _served_as_greedy(s, r, n, {"temperature": 1e-38}),
    "top_p 1e-300": lambda s, r, n: _served_as_greedy(s, r, n, {"temperature": 1, "top_p": 1e-300}),
    "odd Authorization": _odd_authorization,
    "reused request id after hang-up": _reused_request_id,
    "replayed signed call": _replayed_signed_call,
}


def act_bad_input(soak: Soak, rng: random.Random) -> None:
    name = soak.next_bad()
    if name in SPECIAL_CHECKS:
        return SPECIAL_CHECKS[name](soak, rng, name)
    raw = dict(BAD_INPUTS)[name]
    url = rng.choice(soak.routers)
    if name == "kv_transfer_params to an instance":
        url = soak.children["pull-decode-0"].url
    try:
        headers = soak.headers(url)
        status, answer = _request(url, "POST", PATH, raw, timeout_s=soak.timeout_s, headers=headers)
    except (ConnectionError, http.client.HTTPException) as exc:
        status, answer = 0, repr(exc).encode()
    _refused(soak, name, status, answer)


ACTIONS = [act_greedy, act_disconnect, act_early_hangup, act_bad_input]
WEIGHTS = [0.55, 0.1, 0.1, 0.25]


def _client(soak: Soak, seed: int, stop_at: float, stop: threading.Event) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at and not stop.is_set():
        action = rng.choices(ACTIONS, WEIGHTS)[0]
        soak.count("sent")
        try:
            action(soak, rng)
        except TimeoutError:
            soak.count("hung", "hung_actions", f"{action.__name__}: past {soak.timeout_s:g} s")
        except Exception as exc:  # the answer's shape was wrong, or the connection broke
            soak.count("failed_with_error", "error_messages", f"client side: {exc!r}")


def _sample_rss(soak: Soak, stop: threading.Event) -> None:
    soak.sample_rss()
    while not stop.wait(RSS_EVERY_S):
        soak.sample_rss()
    soak.sample_rss()


def _rss_summary(samples: list[float]) -> dict[str, float]:
    """first (after warm-up) / peak / at half time / last of one child's RSS samples (MiB)."""
    if not samples:
        return {}
    half = samples[len(samples) // 2]
    return {"first": samples[0], "peak": max(samples), "half": half, "last": samples[-1]}


# ---- the run ---------------------------------------------------------------------------------


def _warm_up(soak: Soak) -> None:
    """A few requests per router (first contacts, handshakes); not counted."""
    rng = random.Random("warm-up")
    for url in soak.routers:
        for _ in range(4):
            with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
                _greedy(soak, url, soak.body(rng), False)


def _kill(soak: Soak, t0: float) -> None:
    victim = soak.children[VICTIM]
    victim.popen.kill()
    victim.popen.wait()
    soak.killed = {"name": VICTIM, "pid": victim.popen.pid, "at_s": round(time.monotonic() - t0, 1)}


def _load(soak: Soak, args: argparse.Namespace) -> None:
    """--concurrency clients for --duration-s, and the kill in the middle third."""
    t0, stop = time.monotonic(), threading.Event()
    kill_at = random.Random(args.seed).uniform(args.duration_s / 3, 2 * args.duration_s / 3)
    killer = threading.Timer(kill_at, _kill, (soak, t0))
    seeds = [args.seed * 1000 + i for i in range(args.concurrency)]
    clients = [
        threading.Thread(target=_client, args=(soak, seed, t0 + args.duration_s, stop), daemon=True)
        for seed in seeds
    ]
    sampler = threading.Thread(target=_sample_rss, args=(soak, stop), daemon=True)
    try:
        killer.start()
        sampler.start()
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
    finally:
        stop.set()
        killer.cancel()
        sampler.join(timeout=10)


def _settle(child: Child, deadline: float) -> dict[str, Any]:
    """An instance's pool once full (or at the deadline), and its connector's counters."""
    started = time.monotonic()
    while True:
        load = json.loads(_request(child.url, "GET", "/load", timeout_s=5)[1])
        free, total = load["num_free_blocks"], load["num_total_blocks"]
        if free == total or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    pool = {"free_blocks": free, "total_blocks": total, "pool_full": free == total}
    pool["settle_s"] = round(time.monotonic() - started, 1)
    kv = json.loads(_request(child.url, "GET", "/kv_info", timeout_s=5)[1]).get("stats", {})
    return pool | {key: kv[key] for key in KV_STATS if key in kv}


def _report(soak: Soak, start: dict[str, Any]) -> dict[str, Any]:
    deadline, survivors = time.monotonic() + SETTLE_S, {}
    for name, child in soak.children.items():
        if child.alive:
            pool = {} if name.startswith("router") else _settle(child, deadline)
            rss = _rss_summary(soak.rss_mib[name])
            survivors[name] = {"start": start[name], "end": child.proc_stats(), **pool}
            survivors[name]["rss_mib"] = rss
    died = [n for n, c in soak.children.items() if n != VICTIM and not c.alive]
    details = {kind: dict(counter.most_common(20)) for kind, counter in soak.details.items()}
    growing = [
        n
        for n, c in survivors.items()
        if c["rss_mib"] and c["rss_mib"]["last"] - c["rss_mib"]["half"] > RSS_GROWTH_MIB
    ]
    return {
        **{key: soak.counts[key] for key in COUNTS},
        "pools_full": all(s.get("pool_full", True) for s in survivors.values()),
        "children_died": died, "killed": soak.killed, "rss_growing": growing, **details,
        "wrong": soak.wrong[:3], "children": survivors,
    }  # fmt: skip


def _say(line: str, started: float = time.monotonic()) -> None:
    print(f"soak [{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)


def _soak(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    children: list[Child] = []
    token = secrets.token_urlsafe(24)  # the cluster's; the soak signs a replayed call with it
    try:
        _start(model_dir, args, log_dir, children, token)
        soak = Soak(children, vocab_size, args.client_timeout_s, token)
        _say(f"{len(children)} children ready; warming up")
        _warm_up(soak)
        start = {child.name: child.proc_stats() for child in children}
        _say(f"load for {args.duration_s:g} s")
        _load(soak, args)
        _say("load done; settling")
        return _report(soak, start)
    finally:
        _stop(children)


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="soak-logs-"))  # kept: the children's logs
    with tempfile.TemporaryDirectory(prefix="soak-model-") as tmp:
        model_dir = Path(args.model or Path(tmp) / "model")
        if not args.model:
            cmd = [sys.executable, "-m", "disagg.cli", "make-model", *_TINY, "--out"]
            subprocess.run([*cmd, str(model_dir)], check=True, stdout=subprocess.DEVNULL)
        _say(f"model {model_dir}, logs in {log_dir}")
        result = _soak(model_dir, args, log_dir)
    config = {k: _shown_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    # Where this machine kept things is no result: the record names no local path.
    config["cpus"], config["log_dir"] = os.cpu_count(), "(a temporary directory)"
    config["plan"] = [" ".join([n, role, *extra]) for n, role, _, extra in PLAN]
    command = shlex.join(["python", "benchmarks/soak.py", *sys.argv[1:]])
    return {"command": command, "config": config, "results": result}


def _shown_path(path: Path) -> str:
    """A path as the record shows it: relative to the checkout when inside it, else redacted."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return "(a local path)"


# ---- main ------------------------------------------------------------------------------------


def _print_table(result: dict[str, Any]) -> None:
    for key in (*COUNTS, "pools_full", "children_died", "killed", "rss_growing"):
        print(f"{key:>22}  {result[key]}")
    for kind in DETAILS:
        for message, num in result[kind].items():
            print(f"{kind:>22}  {num:>5} x {message}")
    header = f"{'pool free/total':>15} {'rss MiB first/peak/last':>24} {'threads':>8} {'fds':>8}"
    print(f"{'child':>22}  {header}")
    for name, c in result["children"].items():
        pool = f"{c['free_blocks']}/{c['total_blocks']}" if "free_blocks" in c else "-"
        rss = "/".join(f"{c['rss_mib'].get(k, 0):g}" for k in ("first", "peak", "last"))
        moves = [f"{c['start'][k]:g}->{c['end'][k]:g}" for k in ("threads", "fds")]
        print(f"{name:>22}  {pool:>15} {rss:>24} {moves[0]:>8} {moves[1]:>8}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--model", default="", help="a model dir (default: a tiny random one)")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-timeout-s", type=float, default=60.0, help="past it: hung")
    parser.add_argument("--transport", choices=("tcp", "nixl"), default="tcp")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "soak.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: children are stopped
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    started = time.monotonic()
    try:
        doc = run(args)
    except KeyboardInterrupt:
        _say("interrupted; every child stopped")
        return 130
    doc["config"]["wall_s"] = round(time.monotonic() - started, 1)
    res = doc["results"]
    _print_table(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    bad = res["hung"] or res["wrong_token_200"] or res["bad_input_misanswered"]
    is_unwell = res["children_died"] or not res["pools_full"] or res["rss_growing"]
    return 1 if bad or is_unwell else 0


if __name__ == "__main__":
    sys.exit(main())
