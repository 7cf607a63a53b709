"""The cluster's shared secret: signing and checking internal HTTP calls and their answers, the
memory of calls already accepted, and the HMAC that the TCP transport's handshake uses. Pure
Python (hashlib/hmac), no torch, no HTTP library; router and instances use it.

Trust boundary: whoever holds the cluster token may move KV between instances, set
`kv_transfer_params`, and abort requests. The token itself never travels. An internal call
carries `X-Disagg-Signature: t=<unix s>,n=<nonce>,d=<host:port>,s=<hex HMAC-SHA256>`, the MAC
over (t, nonce, destination, method, path, X-Request-Id, body). The verifier accepts it within
WINDOW_S of its clock, only at the destination it names (call_guard.py decides what is
"this process"), and only once: it remembers every accepted nonce until the window would
refuse the call anyway (NonceCache). The answer is signed over the call's nonce, its status
and its body, so a recorded answer is no answer to any other call, and a peer without the
token can neither send a call nor forge a reply.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import secrets
import time
import urllib.parse
from dataclasses import dataclass

__all__ = [
    "MAX_NUM_NONCES",
    "REQUEST_ID_HEADER",
    "SIGNATURE_HEADER",
    "WINDOW_S",
    "NonceCache",
    "Signature",
    "SignatureError",
    "authority_of",
    "bearer_matches",
    "check",
    "check_answer",
    "digest",
    "json_headers",
    "sign",
    "sign_answer",
    "split_authority",
]

SIGNATURE_HEADER = "X-Disagg-Signature"
REQUEST_ID_HEADER = "X-Request-Id"  # signed too: an instance keys the engine request by it
# Hosts' clocks may differ this much (NTP keeps them within a second). Nonces are remembered
# for this long, so it also sizes the replay memory: keep it short.
WINDOW_S = 30.0
MAX_NUM_NONCES = 100_000  # ~20 MB at most; 3,300 signed calls/s within one window
_NONCE_BYTES = 16
_DEFAULT_PORTS = {"http": 80, "https": 443}


class SignatureError(ValueError):
    """A call or an answer whose signature does not hold; the message says why (for a 401)."""


def digest(secret: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `parts`, each length-prefixed so no two splits of the same bytes agree."""
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def authority_of(url: str) -> str:
    """`scheme://host[:port]/...` -> `host:port`: lower-case host, the port always written
    (the scheme's default when absent), IPv6 in brackets. What a call is signed for."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or _DEFAULT_PORTS.get(parts.scheme)
    if not host or port is None:
        raise ValueError(f"a signed call needs a URL with a host, got {url!r}")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_authority(authority: str) -> tuple[str, int]:
    """`host:port` (IPv6 in brackets) -> (host without brackets, port). ValueError if not."""
    host, sep, port = authority.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {authority!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _target(url: str) -> str:
    """The request target a client sends for `url` (path and query), as the server reads it."""
    parts = urllib.parse.urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


@dataclass(frozen=True, slots=True)
class Signature:
    """One call's signature, as its header carries it."""

    stamp: int  # unix seconds when signed
    nonce: str  # 32 hex digits, fresh for every call: a verifier accepts each once
    authority: str  # "host:port" the caller sent the call to
    mac: bytes  # HMAC-SHA256 over all of the above and the call itself

    @property
    def header(self) -> str:
        return f"t={self.stamp},n={self.nonce},d={self.authority},s={self.mac.hex()}"

    @classmethod
    def parse(cls, header: str) -> Signature:
        try:
            fields = dict(item.split("=", 1) for item in header.split(","))
            signature = cls(int(fields["t"]), fields["n"], fields["d"], bytes.fromhex(fields["s"]))
            split_authority(signature.authority)
        except (ValueError, KeyError) as exc:
            raise SignatureError("malformed cluster signature") from exc
        if len(signature.nonce) != 2 * _NONCE_BYTES:
            raise SignatureError("malformed cluster signature (nonce)")
        return signature


def _call_mac(
    secret: str, s: Signature, method: str, target: str, request_id: str, body: bytes
) -> bytes:
    fields = (str(s.stamp), s.nonce, s.authority, method.upper(), target, request_id)
    return digest(secret, b"call", *(f.encode() for f in fields), body)


def sign(
    secret: str,
    method: str,
    url: str,
    body: bytes,
    *,
    request_id: str = "",
    now: float | None = None,
) -> Signature:
    """The signature of one call to `url` (its X-Request-Id header, if it sends one, must be
    `request_id`). Each call gets a fresh nonce: sign again to send again."""
    stamp = int(time.time() if now is None else now)
    unsigned = Signature(stamp, secrets.token_hex(_NONCE_BYTES), authority_of(url), b"")
    mac = _call_mac(secret, unsigned, method, _target(url), request_id, body)
    return Signature(unsigned.stamp, unsigned.nonce, unsigned.authority, mac)


def json_headers(secret: str, url: str, body: bytes, *, request_id: str = "") -> dict[str, str]:
    """Headers of a JSON POST to `url`, signed with `secret` (unsigned when it is empty)."""
    headers = {"Content-Type": "application/json"}
    if secret:
        signature = sign(secret, "POST", url, body, request_id=request_id)
        headers[SIGNATURE_HEADER] = signature.header
    return headers


def check(
    secret: str,
    header: str | None,
    method: str,
    target: str,
    body: bytes,
    *,
    request_id: str = "",
    now: float | None = None,
) -> Signature:
    """The signature in `header` if it signs this call (`target`: path and query as received)
    with `secret` within the window. Does not check the destination or replays (the caller
    does, with what it knows of itself). Raises SignatureError saying why not."""
    if not header:
        raise SignatureError("missing cluster signature")
    signature = Signature.parse(header)
    age_s = abs((time.time() if now is None else now) - signature.stamp)
    if age_s > WINDOW_S:
        raise SignatureError(f"cluster signature is {age_s:.0f}s old (window {WINDOW_S:.0f}s)")
    wanted = _call_mac(secret, signature, method, target, request_id, body)
    if not hmac.compare_digest(wanted, signature.mac):
        raise SignatureError("bad cluster signature")
    return signature


def _answer_mac(secret: str, call_nonce: str, status: int, body: bytes) -> bytes:
    return digest(secret, b"answer", call_nonce.encode(), str(status).encode(), body)


def sign_answer(secret: str, call_nonce: str, status: int, body: bytes) -> str:
    """The signature header value of the answer (`status`, `body`) to the call `call_nonce`."""
    return f"s={_answer_mac(secret, call_nonce, status, body).hex()}"


def check_answer(
    secret: str, header: str | None, call_nonce: str, status: int, body: bytes
) -> None:
    """Raises SignatureError unless `header` signs this answer to the call `call_nonce`."""
    if not header or not header.startswith("s="):
        raise SignatureError("the answer carries no cluster signature")
    try:
        given = bytes.fromhex(header.removeprefix("s="))
    except ValueError as exc:
        raise SignatureError("malformed answer signature") from exc
    if not hmac.compare_digest(_answer_mac(secret, call_nonce, status, body), given):
        raise SignatureError("the answer's signature is not for this call")


class NonceCache:
    """The nonces of accepted calls, each kept until its signature would be refused as too old
    anyway, so the same signed call is accepted once.

    Memory is bounded by `max_num_nonces`. At the bound the nonce that expires first is
    forgotten, and from then on every signature that would expire as early is refused as
    well (the floor): under that load the window shrinks, and a replay is never let in."""

    def __init__(self, window_s: float = WINDOW_S, max_num_nonces: int = MAX_NUM_NONCES) -> None:
        assert max_num_nonces > 0, f"max_num_nonces must be > 0, got {max_num_nonces}"
        self.window_s = window_s
        self.max_num_nonces = max_num_nonces
        self._expiry_s: dict[str, float] = {}  # nonce -> when its signature leaves the window
        self._heap: list[tuple[float, str]] = []  # the same pairs, soonest expiry first
        self._floor_s = float("-inf")  # signatures expiring at or before this are refused

    def __len__(self) -> int:
        return len(self._expiry_s)

    def admit(self, signature: Signature, now: float) -> None:
        """Remember `signature`'s nonce; raises SignatureError if it was seen (a replay) or
        if it is older than what the cache can still vouch for."""
        self._forget_expired(now)
        expiry_s = signature.stamp + self.window_s
        if signature.nonce in self._expiry_s:
            raise SignatureError("replayed cluster call (its nonce was already used)")
        if expiry_s <= self._floor_s:
            raise SignatureError("cluster signature too old for the replay cache (it is full)")
        self._expiry_s[signature.nonce] = expiry_s
        heapq.heappush(self._heap, (expiry_s, signature.nonce))
        while len(self._heap) > self.max_num_nonces:
            self._floor_s = max(self._floor_s, self._pop()[0])

    def _forget_expired(self, now: float) -> None:
        while self._heap and self._heap[0][0] < now:
            self._pop()

    def _pop(self) -> tuple[float, str]:
        expiry_s, nonce = heapq.heappop(self._heap)
        del self._expiry_s[nonce]
        return expiry_s, nonce


def bearer_matches(authorization: str, api_key: str) -> bool:
    """True if an `Authorization` header value is `Bearer <api_key>` (compared in constant
    time): the OpenAI API key check, on instances and on the router alike."""
    scheme, _, key = authorization.partition(" ")
    # As bytes: compare_digest refuses str with non-ASCII characters (TypeError, an HTTP 500).
    # surrogatepass: a header's undecodable bytes arrive as lone surrogates.
    given, wanted = (k.encode("utf-8", "surrogatepass") for k in (key.strip(), api_key))
    return scheme.lower() == "bearer" and hmac.compare_digest(given, wanted)
