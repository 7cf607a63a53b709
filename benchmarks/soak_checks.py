"""How the soak judges a bad or odd input's answer: a 4xx in the OpenAI error shape for the
bad ones, the reference text for the odd-but-valid ones, and a check of their own for odd
Authorization headers, a request id reused after a hang-up and a replayed signed call.

Only sends and counts; the inputs themselves are soak_inputs.py's.
"""

from __future__ import annotations

import http.client
import json
import random
from typing import Any

from soak_http import JSON_HEADERS, PATH, connect, error_message, hang_up, loads, request
from soak_inputs import BAD_INPUTS, ODD_AUTHORIZATIONS
from soak_state import Soak, greedy


def _served_as_greedy(soak: Soak, rng: random.Random, name: str, extra: dict[str, Any]) -> None:
    """A valid request that must be served with the greedy reference text: a 4xx is wrong."""
    url, body = rng.choice(soak.routers), {**soak.body(rng), **extra}
    _count_served(soak, name, *greedy(soak, url, body, False))


def _refused(soak: Soak, name: str, status: int, answer: bytes) -> None:
    """Count a bad input's answer: right when a 4xx in the OpenAI error shape."""
    if 400 <= status < 500 and error_message(loads(answer)):
        return soak.count("rejected_ok", "rejected_by_input", f"{name}: HTTP {status}")
    detail = f"{name}: HTTP {status}: {answer[:120]!r}"
    soak.count("bad_input_misanswered", "misanswered_inputs", detail)


def _odd_authorization(soak: Soak, rng: random.Random, name: str) -> None:
    url, value = rng.choice(soak.routers), rng.choice(ODD_AUTHORIZATIONS)
    if soak.headers(url):  # router-push: refused as any wrong key
        data, headers = json.dumps(soak.body(rng)).encode(), {"Authorization": value}
        status, answer = request(url, "POST", PATH, data, timeout_s=soak.timeout_s, headers=headers)
        ok = status == 401 and error_message(loads(answer))
        return _refused(soak, name, status if ok else 0, answer)
    # No key asked for: the header is nobody's business, so the request fares as any other
    # (an injected transfer failure included); only a refusal is wrong.
    _count_served(soak, name, *greedy(soak, url, soak.body(rng), False, {"Authorization": value}))


def _count_served(soak: Soak, name: str, outcome: str, status: int, message: str) -> None:
    """Count a valid request's greedy outcome; a 4xx (a refusal) is a misanswered input."""
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
    conn = connect(url, soak.timeout_s)
    try:
        stream = json.dumps({**body, "max_tokens": 64, "stream": True})
        conn.request("POST", PATH, stream, {**JSON_HEADERS, **headers})
        conn.getresponse().readline()  # the first event: the engine holds the id
    finally:
        hang_up(conn)
    outcome, status, message = greedy(soak, url, body, False, headers)
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
    first, _ = request(url, "POST", "/v1/abort", data, timeout_s=soak.timeout_s, headers=headers)
    status, answer = request(
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
        status, answer = request(url, "POST", PATH, raw, timeout_s=soak.timeout_s, headers=headers)
    except (ConnectionError, http.client.HTTPException) as exc:
        status, answer = 0, repr(exc).encode()
    _refused(soak, name, status, answer)
