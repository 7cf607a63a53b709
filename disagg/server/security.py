"""Who may call what on an instance: the public OpenAI API (open, or behind `--api-key`) and the
internal routes (`/kv/*`, `/v1/abort`), which only a holder of the cluster token may call.

An internal call proves itself with a signature for this instance that is used once
(disagg.security.call_guard); the answer to it is signed over the call's nonce so the caller knows
which instance spoke to which call. A request carrying `kv_transfer_params` must be signed
too (the app checks `is_cluster_call`): those fields name blocks and peers, so only the router
may set them. With a cluster token, a signature that does not verify (replayed, for another
instance, too old) is refused with 401 on every route, never taken as an unsigned call.
Must not parse bodies or touch the engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg.security import auth
from disagg.security.auth import Signature
from disagg.security.call_guard import CallGuard, Identity
from disagg.server.openai_api import APIError

__all__ = ["INTERNAL_PREFIXES", "is_cluster_call", "make_auth_middleware"]

INTERNAL_PREFIXES = ("/kv/", "/v1/abort")
_PUBLIC_PREFIX = "/v1/"  # the OpenAI API; /health, /load, /metrics, /kv_info stay open
_CLUSTER_KEY = web.RequestKey("is_cluster_call", bool)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_cluster_call(request: web.Request) -> bool:
    """True when the request carried a valid cluster signature."""
    return bool(request.get(_CLUSTER_KEY, False))


def make_auth_middleware(
    *, api_key: str, cluster_token: str, identity: Identity | None = None
) -> Callable[..., object]:
    """`identity`: the names this instance answers to besides the address a call reaches
    (its advertised URL and hosts; see disagg.security.call_guard)."""
    guard = CallGuard(cluster_token, identity) if cluster_token else None

    @web.middleware
    async def check_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        signature = await _cluster_signature(request, guard)
        request[_CLUSTER_KEY] = signature is not None
        if request.path.startswith(INTERNAL_PREFIXES):
            if guard is None:
                raise APIError(403, "internal routes are off: no cluster token", code="forbidden")
            if signature is None:
                raise APIError(401, "internal route: missing cluster signature",
                               code="unauthorized")  # fmt: skip
            return guard.sign_answer(signature, await handler(request))
        if api_key and request.path.startswith(_PUBLIC_PREFIX) and signature is None:
            _check_bearer(request, api_key)
        return await handler(request)

    return check_auth


async def _cluster_signature(request: web.Request, guard: CallGuard | None) -> Signature | None:
    """The request's verified cluster signature; None when it carries none (or the instance
    has no token). Raises 401 for one that does not verify."""
    if guard is None or auth.SIGNATURE_HEADER not in request.headers:
        return None
    try:
        return await guard.check(request)
    except auth.SignatureError as exc:
        raise APIError(401, f"{request.path}: {exc}", code="unauthorized") from exc


def _check_bearer(request: web.Request, api_key: str) -> None:
    if not auth.bearer_matches(request.headers.get("Authorization", ""), api_key):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                       code="invalid_api_key")  # fmt: skip
