"""abuse_bench.py's attacks: oversized prompts and stop lists to the router and to D, and
signed internal calls (a pull prefill leg, an abort) recorded and replayed. Each sends its
requests and returns what came back; the bench measures the victim around it.

Sends only what an attacker could; never starts or stops a process.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from abuse_clients import VICTIM_PROMPT, error_message, request

from disagg.protocol import KVTransferParams
from disagg.router.call import prefill_body
from disagg.security import auth

BIG_PROMPT_CHARS = 15_000_000
NUM_STOP_TOKEN_IDS = 1_500_000
NUM_STOP, STOP_CHARS = 1000, 2000
NUM_REPLAYS = 40  # copies of a recorded call, sent 8 at a time


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
            status, raw, elapsed_s = request(url, "POST", path, data)
            sent.append((status, elapsed_s, error_message(raw)))
        return {"sent": sent, "body_mb": round(len(data) / 1e6, 1)}

    return send


def big_text(num_chars: int) -> str:
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
        answers = list(pool.map(lambda _: request(url, "POST", path, data, headers),
                                range(NUM_REPLAYS)))  # fmt: skip
    return [(status, elapsed_s, error_message(raw)) for status, raw, elapsed_s in answers]


def _free_blocks(url: str) -> int | None:
    status, raw, _ = request(url, "GET", "/load")
    return json.loads(raw)["num_free_blocks"] if status == 200 else None


def _free_blocks_settled(url: str, timeout_s: float = 5.0) -> int | None:
    """P's free blocks once its pool is full again (frees are asynchronous), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, raw, _ = request(url, "GET", "/load")
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
    leg = KVTransferParams(do_remote_decode=True, connector="pull")
    data = json.dumps(prefill_body(client, leg))
    data_b, p = data.encode(), target.prefill_url
    headers = _signed(target, p, "/v1/completions", data_b, request_id)
    first, _, _ = request(p, "POST", "/v1/completions", data_b, headers)
    free_after_first = _free_blocks(p)
    sent = _replays(p, "/v1/completions", data_b, headers)
    status, raw, elapsed_s = request(target.decode_url, "POST", "/v1/completions", data_b, headers)
    sent.append((status, elapsed_s, error_message(raw)))
    stale = _signed(target, p, "/v1/completions", data_b, request_id, now=time.time() - 60)
    status, raw, elapsed_s = request(p, "POST", "/v1/completions", data_b, stale)
    sent.append((status, elapsed_s, error_message(raw)))
    free_after_replays = _free_blocks(p)
    release = json.dumps({"request_id": request_id}).encode()
    released, _, _ = request(p, "POST", "/kv/release", release,
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
    first, _, _ = request(d, "POST", "/v1/abort", data, headers)
    sent = _replays(d, "/v1/abort", data, headers)
    status, raw, elapsed_s = request(target.prefill_url, "POST", "/v1/abort", data, headers)
    sent.append((status, elapsed_s, error_message(raw)))
    return {"sent": sent, "first_status": first}


def make_attacks() -> list[Attack]:
    text = big_text(BIG_PROMPT_CHARS)
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
