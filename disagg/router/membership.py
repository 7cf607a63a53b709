"""The router's membership routes: instances register, heartbeat and leave on their own.

`POST /internal/register` {"url", "role", "draining"} is both the first registration and every
heartbeat (`disagg serve --router URL` sends one per `--heartbeat-s`); `draining: true` says the
instance is finishing what it has and takes no new work. `POST /internal/deregister` {"url"}
removes it once drained. Both must be signed with the cluster token for this router (its
listen host or `--advertise-url`, see security/call_guard.py) and are accepted once, as instances
check the router's calls: an unsigned caller could otherwise add itself to the pool and
receive clients' prompts, and a recorded "draining" or deregister, sent again, would keep an
instance out of it. Answers are signed over the call. Must not route requests (flows.py) nor
probe instances (instances.py).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from disagg.config import RouterConfig
from disagg.protocol import DEREGISTER_PATH, REGISTER_PATH
from disagg.router.instances import InstancePool, MembershipError
from disagg.router.relay import RouteError
from disagg.security import auth
from disagg.security.auth import Signature
from disagg.security.call_guard import CallGuard, Identity

__all__ = ["add_membership_routes"]


def add_membership_routes(app: web.Application, pool: InstancePool, cfg: RouterConfig) -> None:
    if not cfg.cluster_token:
        app.router.add_post(REGISTER_PATH, _registration_off)
        app.router.add_post(DEREGISTER_PATH, _registration_off)
        return
    guard = CallGuard(cfg.cluster_token, _identity(cfg))

    async def register(request: web.Request) -> web.StreamResponse:
        body, signature = await _signed_body(request, guard)
        try:
            inst = pool.register(
                _text(body, "url"), _text(body, "role"), is_draining=bool(body.get("draining"))
            )
        except MembershipError as exc:
            raise RouteError.of(409, str(exc)) from exc
        except ValueError as exc:  # a URL that is not one
            raise RouteError.of(400, str(exc)) from exc
        answer = {"url": inst.url, "role": inst.role, "draining": inst.is_draining}
        return guard.sign_answer(signature, web.json_response(answer))

    async def deregister(request: web.Request) -> web.StreamResponse:
        body, signature = await _signed_body(request, guard)
        try:
            known = pool.deregister(_text(body, "url"))
        except ValueError as exc:
            raise RouteError.of(400, str(exc)) from exc
        return guard.sign_answer(signature, web.json_response({"removed": known}))

    app.router.add_post(REGISTER_PATH, register)
    app.router.add_post(DEREGISTER_PATH, deregister)


def _identity(cfg: RouterConfig) -> Identity:
    """Instances sign for the router URL they were given: its listen host at its port, or a
    name the router cannot see from inside (a Service, a proxy), which --advertise-url gives."""
    return Identity.of((cfg.advertise_url,), (cfg.host,))


async def _registration_off(_request: web.Request) -> web.Response:
    raise RouteError.of(403, "registration is off: the router has no cluster token")


async def _signed_body(request: web.Request, guard: CallGuard) -> tuple[dict[str, Any], Signature]:
    try:
        signature = await guard.check(request)
    except auth.SignatureError as exc:
        raise RouteError.of(401, f"{request.path}: {exc}") from exc
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise RouteError.of(400, f"{request.path}: body is not JSON") from exc
    if not isinstance(body, dict):
        raise RouteError.of(400, f"{request.path}: body must be a JSON object")
    return body, signature


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise RouteError.of(400, f"{key!r} must be a non-empty string")
    return value
