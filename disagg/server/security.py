"""Who may call what on an instance: the public OpenAI API (open, or behind `--api-key`) and the
internal routes (`/kv/*`, `/v1/abort`), which only a holder of the cluster token may call.

An internal call proves itself with a signature over its body (disagg.auth); the answer to it
is signed the same way so the caller knows which instance spoke. A request carrying
`kv_transfer_params` must be signed too (the app checks `is_cluster_call`): those fields name
blocks and peers, so only the router may set them. Must not parse bodies or touch the engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg import auth
from disagg.server.openai_api import APIError

__all__ = ["INTERNAL_PREFIXES", "is_cluster_call", "make_auth_middleware"]

INTERNAL_PREFIXES = ("/kv/", "/v1/abort")
_PUBLIC_PREFIX = "/v1/"  # the OpenAI API; /health, /load, /metrics, /kv_info stay open
_CLUSTER_KEY = web.RequestKey("is_cluster_call", bool)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_cluster_call(request: web.Request) -> bool:
    """True when the request carried a valid cluster signature."""
    return bool(request.get(_CLUSTER_KEY, False))


def make_auth_middleware(*, api_key: str, cluster_token: str) -> Callable[..., object]:
    @web.middleware
    async def check_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        problem = await _cluster_problem(request, cluster_token)
        request[_CLUSTER_KEY] = problem is None
        if request.path.startswith(INTERNAL_PREFIXES):
            if not cluster_token:
                raise APIError(403, "internal routes are off: no cluster token", code="forbidden")
            if problem is not None:
                raise APIError(401, f"internal route: {problem}", code="unauthorized")
            return _signed(await handler(request), request.path, cluster_token)
        if api_key and request.path.startswith(_PUBLIC_PREFIX) and problem is not None:
            _check_bearer(request, api_key)
        return await handler(request)

    return check_auth


async def _cluster_problem(request: web.Request, cluster_token: str) -> str | None:
    """None if the request is signed with the cluster token, else why not."""
    header = request.headers.get(auth.SIGNATURE_HEADER)
    if not cluster_token:
        return "no cluster token configured"
    if header is None:
        return "missing cluster signature"
    body = await request.read()  # aiohttp keeps it: the handler reads it again for free
    return auth.verify(cluster_token, header, request.method, request.path, body)


def _check_bearer(request: web.Request, api_key: str) -> None:
    if not auth.bearer_matches(request.headers.get("Authorization", ""), api_key):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                       code="invalid_api_key")  # fmt: skip


def _signed(response: web.StreamResponse, path: str, cluster_token: str) -> web.StreamResponse:
    if isinstance(response, web.Response) and isinstance(response.body, bytes):
        response.headers[auth.SIGNATURE_HEADER] = auth.sign(
            cluster_token, auth.ANSWER, path, response.body
        )
    return response
