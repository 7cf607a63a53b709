"""The router's membership routes: instances register, heartbeat and leave on their own.

`POST /internal/register` {"url", "role", "draining"} is both the first registration and every
heartbeat (`disagg serve --router URL` sends one per `--heartbeat-s`); `draining: true` says the
instance is finishing what it has and takes no new work. `POST /internal/deregister` {"url"}
removes it once drained. Both must be signed with the cluster token (as the router signs its
own calls to instances): an unsigned caller could otherwise add itself to the pool and receive
clients' prompts. Must not route requests (app.py) nor probe instances (instances.py).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from disagg import auth
from disagg.protocol import DEREGISTER_PATH, REGISTER_PATH
from disagg.router.instances import InstancePool, MembershipError
from disagg.router.relay import RouteError

__all__ = ["add_membership_routes"]


def add_membership_routes(app: web.Application, pool: InstancePool, cluster_token: str) -> None:
    async def register(request: web.Request) -> web.Response:
        body = await _signed_body(request, cluster_token)
        try:
            inst = pool.register(
                _text(body, "url"), _text(body, "role"), is_draining=bool(body.get("draining"))
            )
        except MembershipError as exc:
            raise RouteError.of(409, str(exc)) from exc
        except ValueError as exc:  # a URL that is not one
            raise RouteError.of(400, str(exc)) from exc
        return web.json_response({"url": inst.url, "role": inst.role, "draining": inst.is_draining})

    async def deregister(request: web.Request) -> web.Response:
        body = await _signed_body(request, cluster_token)
        try:
            known = pool.deregister(_text(body, "url"))
        except ValueError as exc:
            raise RouteError.of(400, str(exc)) from exc
        return web.json_response({"removed": known})

    app.router.add_post(REGISTER_PATH, register)
    app.router.add_post(DEREGISTER_PATH, deregister)


async def _signed_body(request: web.Request, cluster_token: str) -> dict[str, Any]:
    if not cluster_token:
        raise RouteError.of(403, "registration is off: the router has no cluster token")
    raw = await request.read()
    header = request.headers.get(auth.SIGNATURE_HEADER)
    problem = auth.verify(cluster_token, header, request.method, request.path, raw)
    if problem is not None:
        raise RouteError.of(401, f"{request.path}: {problem}")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise RouteError.of(400, f"{request.path}: body is not JSON") from exc
    if not isinstance(body, dict):
        raise RouteError.of(400, f"{request.path}: body must be a JSON object")
    return body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise RouteError.of(400, f"{key!r} must be a non-empty string")
    return value
