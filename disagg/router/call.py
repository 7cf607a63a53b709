"""One client request as the router proxies it, and the request bodies of its legs.

Pure shaping of JSON bodies (no network): what P is sent (the request cut to one token, not
streamed), what `kv_transfer_params` each leg carries, and the checks a body must pass first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from disagg.protocol import KVTransferParams
from disagg.router.relay import RouteError
from disagg.server.openai_api import (
    APIError,
    check_prompt_size,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)

__all__ = ["Call", "kv_params", "parse_call", "prefill_body", "push_params"]

# Bigger bodies are parsed and checked on a worker thread: the walk over a multi-MB body holds
# the GIL in bytecode, which lets the event loop (other clients' streams) in between.
_INLINE_PARSE_BYTES = 256 * 1024


@dataclass(slots=True)
class Call:
    """One client request as the router proxies it."""

    request: web.Request  # the client's, which the answer is written to
    path: str  # "/v1/completions" | "/v1/chat/completions"
    body: dict[str, Any]  # the client's JSON body, never mutated
    request_id: str  # sent to every leg as X-Request-Id
    upstream_headers: dict[str, str]
    started_s: float = field(default_factory=time.monotonic)

    def body_with(self, params: dict[str, Any]) -> dict[str, Any]:
        return {**self.body, "kv_transfer_params": params}

    def retry(self, request_id: str) -> Call:
        """The same client request under a new id (the legs of the first try may still hold
        the old one while their aborts land)."""
        headers = {**self.upstream_headers, "X-Request-Id": request_id}
        return Call(self.request, self.path, self.body, request_id, headers, self.started_s)


def kv_params(**values: Any) -> dict[str, Any]:
    """`kv_transfer_params` for a leg, named as KVTransferParams names them; unset flags omitted."""
    return {k: v for k, v in KVTransferParams(**values).to_dict().items() if v is not False}


def push_params(
    transfer_id: str, engine_id: str, kv_host: str, kv_port: int, decode_engine_id: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P's, D's) `kv_transfer_params` for one push handoff: both keyed by `transfer_id`; D is
    told which prefill instance (engine id and KV side channel) will write into its blocks,
    and P which decode instance alone may register blocks for it."""
    p_params = kv_params(
        do_remote_decode=True,
        connector="push",
        transfer_id=transfer_id,
        remote_engine_id=decode_engine_id,
    )
    d_params = kv_params(
        do_remote_prefill=True,
        connector="push",
        transfer_id=transfer_id,
        remote_engine_id=engine_id,
        remote_host=kv_host,
        remote_port=kv_port,
    )
    return p_params, d_params


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The P leg: the same request cut to one token, not streamed, keeping its KV for D."""
    dropped = ("max_completion_tokens", "min_tokens", "stream_options")
    out = {k: v for k, v in body.items() if k not in dropped}
    out.update(max_tokens=1, stream=False, kv_transfer_params=params)
    return out


def _check_request(path: str, body: dict[str, Any], max_prompt_chars: int | None) -> None:
    """The checks that need neither tokenizer nor engine, before any leg is sent: a request an
    instance would refuse must not cost a prefill and a held lease first."""
    parse = parse_chat_request if path.endswith("/chat/completions") else parse_completion_request
    try:
        parsed = parse({k: v for k, v in body.items() if k != "kv_transfer_params"})
        check_prompt_size(parsed, max_prompt_chars)
    except APIError as exc:
        raise RouteError.of(exc.status, exc.message, param=exc.param) from exc


def _parse_body(raw: bytes, path: str, max_prompt_chars: int | None) -> dict[str, Any]:
    try:
        body = parse_json_body(raw)
    except APIError as exc:  # not JSON, not an object, too deep, lone surrogate, 1e309
        raise RouteError.of(exc.status, exc.message, param=exc.param) from exc
    if not isinstance(body.get("stream", False), bool):
        raise RouteError.of(400, "stream must be a boolean")
    _check_request(path, body, max_prompt_chars)
    return body


async def parse_call(
    request: web.Request, request_id: str, max_prompt_chars: int | None = None
) -> Call:
    """The client's request, checked (RouteError when it is refused). Text and chat prompts
    over `max_prompt_chars` characters (None: no bound) are refused before any leg."""
    raw = await request.read()
    if len(raw) > _INLINE_PARSE_BYTES:
        body = await asyncio.to_thread(_parse_body, raw, request.path, max_prompt_chars)
    else:
        body = _parse_body(raw, request.path, max_prompt_chars)
    if "kv_transfer_params" in body:
        # They name blocks and peers: only the router sets them, on the legs it sends.
        raise RouteError.of(
            400,
            "kv_transfer_params is set by the router, not by clients",
            param="kv_transfer_params",
        )
    headers = {"X-Request-Id": request_id}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    return Call(request, request.path, body, request_id, headers)
