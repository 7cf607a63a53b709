"""The KV side channel as HTTP routes on the instance's port: each connector handler
(`POST /kv/handshake`, `/kv/register`, `/kv/cancel`, `/kv/release`) mounted behind the app's
cluster-signature check (server/security.py), its JSON body in, its JSON answer out.

Owns the HTTP shape only; what a call means is the connector's (disagg.kv). Must not keep state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from disagg.kv.common import SideChannelError, SideHandler
from disagg.server.openai_api import status_code_name

__all__ = ["kv_routes"]


def kv_routes(handlers: Mapping[str, SideHandler]) -> list[web.RouteDef]:
    return [web.post(path, _adapt(handler)) for path, handler in handlers.items()]


def _adapt(handler: SideHandler) -> Any:
    async def route(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return _error(400, f"side channel: malformed JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "side channel: the body must be a JSON object")
        try:
            return web.json_response(await handler(body))
        except SideChannelError as exc:
            return _error(exc.status, exc.message)

    return route


def _error(status: int, message: str) -> web.Response:
    code = status_code_name(status)  # a string, as every other error body's code
    body = {"error": {"message": message, "type": "kv_error", "param": None, "code": code}}
    return web.json_response(body, status=status)
