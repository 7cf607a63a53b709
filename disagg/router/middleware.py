"""The router's middleware: every error in OpenAI's shape (aiohttp's own 404/405/413 too), and
the optional API key (`Authorization: Bearer KEY`) on the OpenAI routes.

Must not route or proxy (app.py).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from aiohttp import web

from disagg.router.relay import RouteError
from disagg.security import auth

__all__ = ["api_key_middleware", "error_middleware"]

logger = logging.getLogger(__name__)


@web.middleware
async def error_middleware(
    request: web.Request, handler: aiohttp.typedefs.Handler
) -> web.StreamResponse:
    """Every router error leaves as JSON in the OpenAI shape, aiohttp's own 404/405/413 too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error_response(exc)
    except RouteError as exc:  # a handler's own refusal, already in the OpenAI shape
        return exc.to_response()
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return RouteError.of(500, "internal router error").to_response()


def api_key_middleware(api_key: str) -> Any:
    @web.middleware
    async def check_api_key(
        request: web.Request, handler: aiohttp.typedefs.Handler
    ) -> web.StreamResponse:
        if api_key and request.path.startswith("/v1/"):
            if not auth.bearer_matches(request.headers.get("Authorization", ""), api_key):
                message = "invalid or missing API key (Authorization: Bearer ...)"
                return RouteError.of(401, message, code="invalid_api_key").to_response()
        return await handler(request)

    return check_api_key


def _http_error_response(exc: web.HTTPException) -> web.Response:
    """aiohttp's plain-text error as an OpenAI error; 413 keeps its text (it names the limit)."""
    message = exc.text if exc.status == 413 and exc.text else exc.reason
    response = RouteError.of(exc.status, message).to_response()
    if allow := exc.headers.get("Allow"):
        response.headers["Allow"] = allow
    return response
