"""The soak's load: --concurrency client threads, each picking an action at random (a greedy
request, a mid-stream hang-up, an early hang-up or a bad input) until --duration-s is over;
an RSS sampler beside them, and the one SIGKILL of a push decode instance in the middle third.

Drives and counts; the end-of-run checks are soak_report.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import threading
import time

from soak_checks import act_bad_input
from soak_cluster import VICTIM
from soak_http import JSON_HEADERS, PATH, connect, hang_up
from soak_state import Soak, greedy

RSS_EVERY_S = 5.0  # between RSS samples of every child during the load


def act_greedy(soak: Soak, rng: random.Random) -> None:
    url, streamed = rng.choice(soak.routers), rng.random() < 0.5
    outcome, _, message = greedy(soak, url, soak.body(rng), streamed)
    soak.count(outcome, "error_messages" if message else "", message)


def act_disconnect(soak: Soak, rng: random.Random) -> None:
    """Open a stream, read 1-2 chunks, hang up."""
    url = rng.choice(soak.routers)
    conn = connect(url, soak.timeout_s)
    body = json.dumps({**soak.body(rng), "max_tokens": 64, "stream": True})
    try:
        conn.request("POST", PATH, body, {**JSON_HEADERS, **soak.headers(url)})
        resp, wanted = conn.getresponse(), rng.randint(1, 2)
        while wanted and (line := resp.readline()):
            wanted -= line.startswith(b"data:")
    finally:
        hang_up(conn)
    soak.count("disconnects")


def act_early_hangup(soak: Soak, rng: random.Random) -> None:
    """Send a request (streamed or not) and hang up within 50 ms, before any answer: in pull
    mode during the prefill leg or at the handoff to decode, in push mode while both legs run.
    The pools-full check at the end says whether every leg let go of its blocks."""
    url = rng.choice(soak.routers)
    conn = connect(url, soak.timeout_s)
    body = json.dumps({**soak.body(rng), "stream": rng.random() < 0.5})
    try:
        conn.request("POST", PATH, body, {**JSON_HEADERS, **soak.headers(url)})
        time.sleep(rng.uniform(0.0, 0.05))
    finally:
        hang_up(conn)
    soak.count("early_hangups")


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


def warm_up(soak: Soak) -> None:
    """A few requests per router (first contacts, handshakes); not counted."""
    rng = random.Random("warm-up")
    for url in soak.routers:
        for _ in range(4):
            with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
                greedy(soak, url, soak.body(rng), False)


def _kill(soak: Soak, t0: float) -> None:
    victim = soak.children[VICTIM]
    victim.popen.kill()
    victim.popen.wait()
    soak.killed = {"name": VICTIM, "pid": victim.popen.pid, "at_s": round(time.monotonic() - t0, 1)}


def run_load(soak: Soak, args: argparse.Namespace) -> None:
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
