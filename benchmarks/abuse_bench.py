"""Abuse under load: what the inputs of an adversarial run cost another client now that each is
refused, and whether an instance under a 3.5 GB address-space limit survives a 10 MB prompt.

Per mode (pull, then push; a fresh cluster each, built by the project's launcher on 127.0.0.1:
router + 1 prefill + 1 decode, one torch thread per instance, TCP transport, every limit at its
default), a victim client streams greedy completions of --victim-max-tokens tokens through the
router, one after another, and a poller asks P's and D's /health every HEALTH_EVERY_S. Then, per
attack: --quiet-s with nothing else sent (the baseline window), the attack (--repeats sends,
one after another), and TAIL_S more (a stall may outlast the answer). Recorded per attack: the
attack requests' statuses and latencies; the victim's inter-token gaps (client arrival times of
consecutive chunks of one stream, gaps overlapping the window) p50 / p99 / max in the attack
window against the baseline window just before, and their ratios; the slowest /health of P and
of D in each window. The attacks:
  a 15 MB text prompt and a 15 MB chat prompt, to the router, then to D directly;
  1.5M stop_token_ids; 1000 stop strings of 2000 characters (to the router);
  pull only: a signed prefill leg (shaped and signed as the router sends one) recorded, sent
  once, then NUM_REPLAYS copies to P, one to D (another destination) and one re-signed 60 s
  ago; P's free blocks after each step;
  both: a signed /v1/abort to D recorded, sent once, then NUM_REPLAYS copies, and one to P.
Last, an aggregated instance alone under RLIMIT_AS 3.5 GB gets a 10 MB text prompt and a 10 MB
chat prompt: statuses, alive after each, its memory (VmRSS, VmHWM, VmPeak), then a normal
request. The CPU's model and flags are read from /proc/cpuinfo at run time. Prints a table; the
last stdout line is the JSON document (also written to --out). Exit status 1 if an attack was
not refused as expected, the victim saw an error, or an instance died; timings never fail it.

    python benchmarks/abuse_bench.py [--model DIR] [--modes pull,push] [--repeats 5]
                                     [--quiet-s 3] [--out docs/results/abuse.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import re
import resource
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# soak.py's tiny checkpoint (a decode step is ~1 ms, so a stall of a few ms shows) and its
# connection helper; benchmarks/ is on sys.path when this file runs as a script.
from soak import _TINY, _connect

from disagg.bench.host import cpu_info
from disagg.cluster.config import ClusterConfig
from disagg.cluster.launcher import Cluster
from disagg.config import API_KEY_ENV, CLUSTER_TOKEN_ENV
from disagg.router.call import kv_params, prefill_body
from disagg.security import auth

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]
BIG_PROMPT_CHARS = 15_000_000
LIMITED_PROMPT_CHARS = 10_000_000
ADDRESS_SPACE_BYTES = int(3.5 * 2**30)  # the limit the instance died under before
NUM_STOP_TOKEN_IDS = 1_500_000
NUM_STOP, STOP_CHARS = 1000, 2000
NUM_REPLAYS = 40  # copies of a recorded call, sent 8 at a time
HEALTH_EVERY_S = 0.05  # between two /health probes (P and D in turn)
TAIL_S = 0.5  # after an attack's last answer, still its window
TIMEOUT_S = 60.0  # any one HTTP call, the victim's streams included
START_TIMEOUT_S = 300.0
_SERVE_ARGS = ("--dtype", "float32", "--kv-host", HOST)  # fp32: as the e2e tests measure it
_READY = re.compile(rb"ready on (http://[\w.\-]+:\d+)")
_JSON = {"Content-Type": "application/json"}
VICTIM_PROMPT = [101, 202, 303, 404, 505, 606, 707, 808]


# ---- pure: gap statistics ----------------------------------------------------------------------


def gaps_overlapping(
    chunk_times: list[tuple[int, float]], start_s: float, end_s: float
) -> list[float]:
    """Gaps (s) between consecutive chunks of the same stream that overlap [start_s, end_s].
    `chunk_times`: (stream index, arrival s) in arrival order; a stream's first chunk opens no
    gap (that is its TTFT), nor does the step from one stream to the next."""
    gaps, last = [], {}
    for stream, arrival_s in chunk_times:
        previous = last.get(stream)
        last[stream] = arrival_s
        if previous is not None and previous < end_s and arrival_s > start_s:
            gaps.append(arrival_s - previous)
    return gaps


def gap_stats(gaps: list[float]) -> dict[str, Any]:
    """{num_gaps, median_ms, p99_ms, max_ms} of gaps in seconds (None when there are none)."""
    median, p99 = percentile(gaps, 50), percentile(gaps, 99)
    maximum = max(gaps, default=None)
    return {"num_gaps": len(gaps), "median_ms": _ms(median), "p99_ms": _ms(p99),
            "max_ms": _ms(maximum)}  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, rounded; None when either is missing or the baseline is 0."""
    if value is None or not baseline:
        return None
    return round(value / baseline, 2)


def slowest_health(
    samples: list[tuple[str, float, float, int]], name: str, start_s: float, end_s: float
) -> dict[str, Any]:
    """The slowest /health of `name` among probes started in [start_s, end_s], and how many
    did not answer 200. `samples`: (name, started s, latency s, status; 0 = no answer)."""
    mine = [(lat, status) for n, t, lat, status in samples if n == name and start_s <= t <= end_s]
    slowest = max((lat for lat, _ in mine), default=None)
    return {"num": len(mine), "max_ms": _ms(slowest), "failed": sum(s != 200 for _, s in mine)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


# ---- HTTP --------------------------------------------------------------------------------------


def _request(
    url: str,
    method: str,
    path: str,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, float]:
    """(status, body, seconds to the whole answer); status 0 when the connection failed."""
    started = time.monotonic()
    conn = _connect(url, TIMEOUT_S)
    try:
        conn.request(method, path, body=data, headers={**_JSON, **(headers or {})})
        resp = conn.getresponse()
        status, raw = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        status, raw = 0, repr(exc).encode()
    finally:
        conn.close()
    return status, raw, time.monotonic() - started


def _error_message(raw: bytes) -> str:
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
        conn = _connect(self.url, TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", self.data, _JSON)
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
                status, _, latency_s = _request(url, "GET", "/health")
                self.samples.append((name, started, latency_s, status))
                self._stopping.wait(HEALTH_EVERY_S)


# ---- attacks -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """One cluster as the attacks see it."""

    router_url: str
    prefill_url: str
    decode_url: str
    token: str  # the cluster's: the bench signs the calls it replays (an attacker records them)
    repeats: int


@dataclass(frozen=True, slots=True)
class Attack:
    name: str
    expected: int  # the status every attack request must get
    send: Callable[[Target], dict[str, Any]]  # -> {"sent": [(status, s, message)], ...extra}
    modes: tuple[str, ...] = ("pull", "push")


def _repeated(path: str, data: bytes, to: str = "router") -> Callable[[Target], dict[str, Any]]:
    """Send one body `repeats` times, one after another, to the router or to D directly."""

    def send(target: Target) -> dict[str, Any]:
        url = target.router_url if to == "router" else target.decode_url
        sent = []
        for _ in range(target.repeats):
            status, raw, elapsed_s = _request(url, "POST", path, data)
            sent.append((status, elapsed_s, _error_message(raw)))
        return {"sent": sent, "body_mb": round(len(data) / 1e6, 1)}

    return send


def _big_text(num_chars: int) -> str:
    return ("the quick brown fox jumps over the lazy dog " * (num_chars // 44 + 1))[:num_chars]


def _signed(target: Target, url: str, path: str, data: bytes, request_id: str = "",
            now: float | None = None) -> dict[str, str]:  # fmt: skip
    signature = auth.sign(target.token, "POST", url + path, data, request_id=request_id, now=now)
    headers = {auth.SIGNATURE_HEADER: signature.header}
    return headers | ({auth.REQUEST_ID_HEADER: request_id} if request_id else {})


def _replays(
    url: str, path: str, data: bytes, headers: dict[str, str]
) -> list[tuple[int, float, str]]:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _request(url, "POST", path, data, headers),
                                range(NUM_REPLAYS)))  # fmt: skip
    return [(status, elapsed_s, _error_message(raw)) for status, raw, elapsed_s in answers]


def _free_blocks(url: str) -> int | None:
    status, raw, _ = _request(url, "GET", "/load")
    return json.loads(raw)["num_free_blocks"] if status == 200 else None


def _free_blocks_settled(url: str, timeout_s: float = 5.0) -> int | None:
    """P's free blocks once its pool is full again (frees are asynchronous), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, raw, _ = _request(url, "GET", "/load")
        load = json.loads(raw) if status == 200 else {}
        if (
            load.get("num_free_blocks") == load.get("num_total_blocks")
            or time.monotonic() > deadline
        ):
            return load.get("num_free_blocks")
        time.sleep(0.1)


def replay_prefill_leg(target: Target) -> dict[str, Any]:
    """A pull prefill leg as the router sends it, recorded (headers and body), then replayed:
    to P, to D (another destination), and re-signed 60 s in the past (outside the window).
    The first copy is served and leased; the replays must hold no blocks; a signed
    /kv/release (as the router sends when no decode will read) frees the lease after."""
    request_id = f"abuse-leg-{secrets.token_hex(6)}"
    client = {"prompt": VICTIM_PROMPT * 4, "max_tokens": 8, "temperature": 0}
    data = json.dumps(prefill_body(client, kv_params(do_remote_decode=True, connector="pull")))
    data_b, p = data.encode(), target.prefill_url
    headers = _signed(target, p, "/v1/completions", data_b, request_id)
    first, _, _ = _request(p, "POST", "/v1/completions", data_b, headers)
    free_after_first = _free_blocks(p)
    sent = _replays(p, "/v1/completions", data_b, headers)
    status, raw, elapsed_s = _request(target.decode_url, "POST", "/v1/completions", data_b, headers)
    sent.append((status, elapsed_s, _error_message(raw)))
    stale = _signed(target, p, "/v1/completions", data_b, request_id, now=time.time() - 60)
    status, raw, elapsed_s = _request(p, "POST", "/v1/completions", data_b, stale)
    sent.append((status, elapsed_s, _error_message(raw)))
    free_after_replays = _free_blocks(p)
    release = json.dumps({"request_id": request_id}).encode()
    released, _, _ = _request(p, "POST", "/kv/release", release,
                              _signed(target, p, "/kv/release", release))  # fmt: skip
    return {"sent": sent, "first_status": first, "release_status": released,
            "free_blocks_after_release": _free_blocks_settled(p),
            "free_blocks_after_first": free_after_first,
            "free_blocks_after_replays": free_after_replays}  # fmt: skip


def replay_abort(target: Target) -> dict[str, Any]:
    """A signed /v1/abort to D recorded and replayed: to D, and once to P."""
    data = json.dumps({"request_id": f"abuse-abort-{secrets.token_hex(6)}"}).encode()
    d = target.decode_url
    headers = _signed(target, d, "/v1/abort", data)
    first, _, _ = _request(d, "POST", "/v1/abort", data, headers)
    sent = _replays(d, "/v1/abort", data, headers)
    status, raw, elapsed_s = _request(target.prefill_url, "POST", "/v1/abort", data, headers)
    sent.append((status, elapsed_s, _error_message(raw)))
    return {"sent": sent, "first_status": first}


def make_attacks() -> list[Attack]:
    text = _big_text(BIG_PROMPT_CHARS)
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    short = {"prompt": VICTIM_PROMPT, "max_tokens": 4}
    stop_ids = {**short, "stop_token_ids": [5] * NUM_STOP_TOKEN_IDS}
    stops = {**short, "stop": [f"{i:04d}" + "s" * (STOP_CHARS - 4) for i in range(NUM_STOP)]}
    bodies = {"15 MB text prompt": ("/v1/completions", {"prompt": text, "max_tokens": 4}),
              "15 MB chat prompt": ("/v1/chat/completions", chat),
              "1.5M stop_token_ids": ("/v1/completions", stop_ids),
              "1000 stop strings x 2000 chars": ("/v1/completions", stops)}  # fmt: skip
    attacks = [Attack(name, 400, _repeated(path, json.dumps(body).encode()))
               for name, (path, body) in bodies.items()]  # fmt: skip
    for name in ("15 MB text prompt", "15 MB chat prompt"):  # the instance's own check
        path, body = bodies[name]
        attacks.append(
            Attack(f"{name}, to D", 400, _repeated(path, json.dumps(body).encode(), "D"))
        )
    attacks.append(Attack("replayed signed prefill leg", 401, replay_prefill_leg, ("pull",)))
    attacks.append(Attack("replayed signed abort", 401, replay_abort))
    return attacks


# ---- one mode ----------------------------------------------------------------------------------


def _memory_mib(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM (peak RSS) and VmPeak (peak address space) of a process, in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {
        key: round(int(fields[key].split()[0]) / 1024, 1) for key in ("VmRSS", "VmHWM", "VmPeak")
    }


def _measure(attack: Attack, target: Target, victim: Victim, poller: HealthPoller,
             quiet_s: float) -> dict[str, Any]:  # fmt: skip
    """The quiet window, then the attack and its tail: one row."""
    quiet_start_s = time.monotonic()
    time.sleep(quiet_s)
    start_s = time.monotonic()
    outcome = attack.send(target)
    answered_s = time.monotonic()
    time.sleep(TAIL_S)
    end_s = time.monotonic()
    chunks, samples = list(victim.chunk_times), list(poller.samples)
    base = gap_stats(gaps_overlapping(chunks, quiet_start_s, start_s))
    during = gap_stats(gaps_overlapping(chunks, start_s, end_s))
    sent = outcome.pop("sent")
    statuses = Counter(str(status) for status, _, _ in sent)
    latencies = [elapsed_s for _, elapsed_s, _ in sent]
    health = {name: {"baseline": slowest_health(samples, name, quiet_start_s, start_s),
                     "attack": slowest_health(samples, name, start_s, end_s)}
              for name in poller.targets}  # fmt: skip
    return {
        "attack": attack.name, "statuses": dict(statuses), "expected_status": attack.expected,
        "is_refused": set(statuses) == {str(attack.expected)}, "message": sent[0][2],
        "latency_median_ms": _ms(statistics.median(latencies)),
        "latency_max_ms": _ms(max(latencies)),
        "window_s": round(end_s - start_s, 2), "attack_s": round(answered_s - start_s, 2),
        "victim_baseline": base, "victim_attack": during,
        "median_gap_ratio": ratio(during["median_ms"], base["median_ms"]),
        "p99_gap_ratio": ratio(during["p99_ms"], base["p99_ms"]),
        "max_gap_ratio": ratio(during["max_ms"], base["max_ms"]),
        "health": health, **outcome,
    }  # fmt: skip


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, log_dir: Path,
             token: str, attacks: list[Attack]) -> dict[str, Any]:  # fmt: skip
    config = ClusterConfig(mode=mode, model=str(model_dir), kv_transport="tcp",
                           threads_per_instance=1, serve_args=_SERVE_ARGS,
                           log_dir=log_dir / mode, startup_timeout_s=START_TIMEOUT_S)  # fmt: skip
    _say(f"{mode}: starting router + 1 prefill + 1 decode")
    with Cluster(config) as cluster:
        urls = cluster.instance_urls
        target = Target(cluster.url, urls["prefill"][0], urls["decode"][0], token, args.repeats)
        pids = cluster.pids
        memory_before = {name: _memory_mib(pid) for name, pid in pids.items()}
        victim = Victim(cluster.url, args.victim_max_tokens)
        poller = HealthPoller({"prefill": target.prefill_url, "decode": target.decode_url})
        victim.start()
        poller.start()
        rows = []
        try:
            for attack in (a for a in attacks if mode in a.modes):
                _say(f"{mode}: {attack.name}")
                rows.append(
                    {"mode": mode, **_measure(attack, target, victim, poller, args.quiet_s)}
                )
        finally:
            victim.stop()
            poller.stop()
        died = cluster.dead_process()
        memory_after = {name: _memory_mib(pid) for name, pid in pids.items() if not died}
    return {"rows": rows, "victim_streams": victim.num_streams, "victim_errors": victim.errors[:5],
            "died": died, "memory_mib_before": memory_before,
            "memory_mib_after": memory_after}  # fmt: skip


# ---- the instance under an address-space limit -------------------------------------------------


def _limited_child() -> None:
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: dies with us
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def _wait_ready(popen: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while popen.poll() is None and time.monotonic() < deadline:
        found = _READY.search(log_path.read_bytes())
        if found and _request(found.group(1).decode(), "GET", "/health")[0] == 200:
            return found.group(1).decode()
        time.sleep(0.2)
    raise RuntimeError(f"limited instance did not start:\n{log_path.read_text()[-3000:]}")


def run_limited(model_dir: Path, log_dir: Path) -> dict[str, Any]:
    """An aggregated instance under RLIMIT_AS 3.5 GB: a 10 MB text and chat prompt, then a
    normal request; alive after each, and its memory."""
    _say("limited: one instance under RLIMIT_AS 3.5 GB")
    log_path = log_dir / "limited.log"
    argv = [sys.executable, "-m", "disagg.cli", "serve", "--model", str(model_dir)]
    argv += ["--host", HOST, "--port", "0", "--num-threads", "1", "--role", "both"]
    argv += ["--dtype", "float32"]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, preexec_fn=_limited_child)  # fmt: skip
    try:
        url = _wait_ready(popen, log_path)
        before = _memory_mib(popen.pid)
        text = _big_text(LIMITED_PROMPT_CHARS)
        chat = {"messages": [{"role": "user", "content": text}]}
        sent = []
        for name, path, body in (("10 MB text prompt", "/v1/completions", {"prompt": text}),
                                 ("10 MB chat prompt", "/v1/chat/completions", chat)):  # fmt: skip
            status, raw, elapsed_s = _request(url, "POST", path, json.dumps(body).encode())
            sent.append({"attack": name, "status": status, "latency_ms": _ms(elapsed_s),
                         "message": _error_message(raw),
                         "alive_after": popen.poll() is None})  # fmt: skip
        after = _memory_mib(popen.pid) if popen.poll() is None else {}
        normal = {"prompt": VICTIM_PROMPT, "max_tokens": 4, "temperature": 0}
        status, _, _ = _request(url, "POST", "/v1/completions", json.dumps(normal).encode())
        return {"address_space_limit_gib": ADDRESS_SPACE_BYTES / 2**30, "requests": sent,
                "normal_request_status": status, "alive_at_end": popen.poll() is None,
                "memory_mib_before": before, "memory_mib_after": after}  # fmt: skip
    finally:
        popen.terminate()
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(5)


# ---- the run -----------------------------------------------------------------------------------


def _say(line: str, started: float = time.monotonic()) -> None:
    print(f"abuse_bench [{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cpu = cpu_info()
    token = secrets.token_urlsafe(24)
    os.environ[CLUSTER_TOKEN_ENV] = token  # the launcher hands it to every child
    os.environ.pop(API_KEY_ENV, None)  # an open cluster: the attacker needs no key
    os.environ["OMP_NUM_THREADS"] = "1"
    log_dir = Path(tempfile.mkdtemp(prefix="abuse-bench-logs-"))  # kept: the children's logs
    attacks = make_attacks()
    with tempfile.TemporaryDirectory(prefix="abuse-bench-model-") as tmp:
        model_dir = Path(args.model) if args.model else Path(tmp) / "model"
        if not args.model:
            cmd = [sys.executable, "-m", "disagg.cli", "make-model", *_TINY, "--out"]
            subprocess.run([*cmd, str(model_dir)], check=True, stdout=subprocess.DEVNULL)
        _say(f"model {args.model or 'tiny qwen3'}, logs in {log_dir}")
        modes = {mode: run_mode(mode, model_dir, args, log_dir, token, attacks)
                 for mode in args.modes.split(",")}  # fmt: skip
        limited = run_limited(model_dir, log_dir)
    cpu["loadavg_1m_end"] = os.getloadavg()[0]
    config = {"model": args.model or "tiny qwen3 (" + " ".join(_TINY) + ")",
              "modes": args.modes.split(","), "repeats": args.repeats, "quiet_s": args.quiet_s,
              "tail_s": TAIL_S, "victim_max_tokens": args.victim_max_tokens,
              "health_every_s": HEALTH_EVERY_S, "serve_args": list(_SERVE_ARGS),
              "threads_per_instance": 1, "transport": "tcp"}  # fmt: skip
    command = shlex.join(["python", "benchmarks/abuse_bench.py", *sys.argv[1:]])
    return {"command": command, "cpu": cpu, "config": config, "modes": modes, "limited": limited}


def failures(doc: dict[str, Any]) -> list[str]:
    """What makes the run fail (not timings: the machine is shared)."""
    found = []
    for mode, result in doc["modes"].items():
        found += [
            f"{mode}: {r['attack']}: {r['statuses']}" for r in result["rows"] if not r["is_refused"]
        ]
        found += [f"{mode}: victim: {e}" for e in result["victim_errors"]]
        found += [f"{mode}: died: {result['died']}"] if result["died"] else []
    limited = doc["limited"]
    if not limited["alive_at_end"] or limited["normal_request_status"] != 200:
        found.append(f"limited instance: {limited}")
    found += [f"limited: {r['attack']}: HTTP {r['status']}" for r in limited["requests"]
              if not 400 <= r["status"] < 500]  # fmt: skip
    return found


def _row_line(r: dict[str, Any]) -> str:
    base, att = r["victim_baseline"], r["victim_attack"]
    status = ",".join(f"{k}x{v}" for k, v in r["statuses"].items())
    gaps = " / ".join(f"{base[k]} -> {att[k]}" for k in ("median_ms", "p99_ms", "max_ms"))
    ratios = "/".join(f"{r[k]}" for k in ("median_gap_ratio", "p99_gap_ratio", "max_gap_ratio"))
    health = ", ".join(
        f"{r['health'][n]['baseline']['max_ms']} -> {r['health'][n]['attack']['max_ms']}"
        for n in ("prefill", "decode")
    )
    return (f"{r['mode']:<5} {r['attack']:<36} {status:<9} {r['latency_max_ms']:>10} "
            f"{gaps:>46} {ratios:>16} {health:>36}")  # fmt: skip


def print_table(doc: dict[str, Any]) -> None:
    cpu = doc["cpu"]
    print(f"cpu: {cpu['model']}, {cpu['cpus']} cpus, flags: {' '.join(cpu['flags_shown'])} "
          f"(of {len(cpu['flags'])}); load 1m {cpu['loadavg_1m_start']:.2f} -> "
          f"{cpu['loadavg_1m_end']:.2f} (shared machine: figures are noisy)")  # fmt: skip
    print(f"{'mode':<5} {'attack':<36} {'status':<9} {'lat max ms':>10} "
          f"{'victim gap p50 / p99 / max ms: base -> attack':>46} {'ratios':>16} "
          f"{'/health max ms P, D: base -> attack':>36}")  # fmt: skip
    for result in doc["modes"].values():
        for r in result["rows"]:
            print(_row_line(r))
    limited = doc["limited"]
    for r in limited["requests"]:
        print(
            f"RLIMIT_AS {limited['address_space_limit_gib']} GiB: {r['attack']}: HTTP "
            f"{r['status']} in {r['latency_ms']} ms, alive after: {r['alive_after']}"
        )
    mem = limited["memory_mib_after"]
    print(
        f"RLIMIT_AS: then a normal request: HTTP {limited['normal_request_status']}; "
        f"VmRSS {mem.get('VmRSS')} MiB, peak RSS {mem.get('VmHWM')} MiB, "
        f"peak address space {mem.get('VmPeak')} MiB"
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a model dir (default: a tiny random one)")
    parser.add_argument("--modes", default="pull,push", help="comma list of pull, push")
    parser.add_argument("--repeats", type=int, default=5, help="sends per size/stop attack")
    parser.add_argument("--quiet-s", type=float, default=3.0, help="baseline window per attack")
    parser.add_argument("--victim-max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "abuse.json")
    args = parser.parse_args(argv)
    if set(args.modes.split(",")) - {"pull", "push"}:
        parser.error(f"--modes takes pull and push, got {args.modes!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: children are stopped
    started = time.monotonic()
    doc = run(args)
    doc["config"]["wall_s"] = round(time.monotonic() - started, 1)
    doc["failures"] = failures(doc)
    print_table(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
