"""The cluster's shared secret: signing and checking internal HTTP calls, and the HMAC that the
TCP transport's handshake uses. Pure Python (hashlib/hmac), no torch; router and instances use it.

Trust boundary: whoever holds the cluster token may move KV between instances, set
`kv_transfer_params`, and abort requests. The token itself never travels: an internal call
carries `X-Disagg-Signature: t=<unix seconds>,s=<hex HMAC-SHA256(token, t, method, path, body)>`,
checked within a time window, and an answer to it is signed the same way (method "ANSWER"), so a
peer that does not hold the token can neither send one nor forge a reply.
"""

from __future__ import annotations

import hashlib
import hmac
import time

__all__ = [
    "ANSWER",
    "SIGNATURE_HEADER",
    "WINDOW_S",
    "bearer_matches",
    "digest",
    "json_headers",
    "sign",
    "verify",
]

SIGNATURE_HEADER = "X-Disagg-Signature"
ANSWER = "ANSWER"  # the "method" an answer to a signed call is signed with
WINDOW_S = 300.0  # clocks of two hosts may differ this much; a replay must come within it


def digest(secret: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `parts`, each length-prefixed so no two splits of the same bytes agree."""
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def sign(secret: str, method: str, path: str, body: bytes, *, now: float | None = None) -> str:
    """The signature header value for one call (or answer) with this body."""
    stamp = str(int(time.time() if now is None else now))
    mac = digest(secret, stamp.encode(), method.upper().encode(), path.encode(), body)
    return f"t={stamp},s={mac.hex()}"


def json_headers(secret: str, path: str, body: bytes) -> dict[str, str]:
    """Headers of a JSON POST to `path`, signed with `secret` (unsigned when it is empty)."""
    headers = {"Content-Type": "application/json"}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, "POST", path, body)
    return headers


def verify(
    secret: str,
    header: str | None,
    method: str,
    path: str,
    body: bytes,
    *,
    now: float | None = None,
) -> str | None:
    """None if `header` signs this call with `secret`, else why not (for the error message)."""
    if not header:
        return "missing cluster signature"
    try:
        fields = dict(item.split("=", 1) for item in header.split(","))
        stamp, given = fields["t"], bytes.fromhex(fields["s"])
        age_s = abs((time.time() if now is None else now) - int(stamp))
    except (ValueError, KeyError):
        return "malformed cluster signature"
    if age_s > WINDOW_S:
        return f"cluster signature is {age_s:.0f}s old (window {WINDOW_S:.0f}s)"
    wanted = digest(secret, stamp.encode(), method.upper().encode(), path.encode(), body)
    if not hmac.compare_digest(wanted, given):
        return "bad cluster signature"
    return None


def bearer_matches(authorization: str, api_key: str) -> bool:
    """True if an `Authorization` header value is `Bearer <api_key>` (compared in constant
    time): the OpenAI API key check, on instances and on the router alike."""
    scheme, _, key = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.strip(), api_key)
