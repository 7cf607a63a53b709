"""One client request as the router proxies it, and the request bodies of its legs.

Pure shaping of JSON bodies (no network): what P is sent (the request cut to one token, not
streamed), what `kv_transfer_params` each leg carries, and the checks a body must pass first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from disagg.protocol import KVTransferParams
from disagg.router.body_parser import INLINE_PARSE_BYTES, BodyParser, Refusal
from disagg.router.relay import RouteError
from disagg.server.json_body import parse_json_body
from disagg.server.openai_api import APIError, parse_chat_request, parse_completion_request
from disagg.server.prompt_limits import check_body_size, check_prompt_size

__all__ = [
    "Call",
    "WireParams",
    "checked_body",
    "make_body_parser",
    "parse_call",
    "prefill_body",
    "push_params",
]


class WireParams(Protocol):
    """A leg's `kv_transfer_params`: ours (`KVTransferParams`) or vLLM's (`VLLMParams`)."""

    def to_sparse_dict(self) -> dict[str, Any]:
        """The JSON object the leg carries."""
        ...


@dataclass(slots=True)
class Call:
    """One client request as the router proxies it."""

    request: web.Request  # the client's, which the answer is written to
    path: str  # "/v1/completions" | "/v1/chat/completions"
    body: dict[str, Any]  # the client's JSON body, never mutated
    request_id: str  # sent to every leg as X-Request-Id
    upstream_headers: dict[str, str]
    started_s: float = field(default_factory=time.monotonic)
    prompt_ids: list[int] | None = None  # as the instances will tokenize it, when known

    def body_with(self, params: WireParams) -> dict[str, Any]:
        """The client's body carrying `params` (the form a decode leg is sent)."""
        return {**self.body, "kv_transfer_params": params.to_sparse_dict()}

    def retry(self, request_id: str) -> Call:
        """The same client request under a new id (the legs of the first try may still hold
        the old one while their aborts land)."""
        headers = {**self.upstream_headers, "X-Request-Id": request_id}
        return Call(self.request, self.path, self.body, request_id, headers, self.started_s,
                    self.prompt_ids)  # fmt: skip


def push_params(
    transfer_id: str, engine_id: str, kv_host: str, kv_port: int, decode_engine_id: str | None
) -> tuple[KVTransferParams, KVTransferParams]:
    """(P's, D's) `kv_transfer_params` for one push handoff: both keyed by `transfer_id`; D is
    told which prefill instance (engine id and KV side channel) will write into its blocks,
    and P which decode instance alone may register blocks for it."""
    p_params = KVTransferParams(
        do_remote_decode=True,
        connector="push",
        transfer_id=transfer_id,
        remote_engine_id=decode_engine_id,
    )
    d_params = KVTransferParams(
        do_remote_prefill=True,
        connector="push",
        transfer_id=transfer_id,
        remote_engine_id=engine_id,
        remote_host=kv_host,
        remote_port=kv_port,
    )
    return p_params, d_params


def prefill_body(body: dict[str, Any], params: WireParams) -> dict[str, Any]:
    """The P leg: the same request cut to one token, not streamed, keeping its KV for D."""
    dropped = ("max_completion_tokens", "min_tokens", "stream_options")
    out = {k: v for k, v in body.items() if k not in dropped}
    out.update(max_tokens=1, stream=False, kv_transfer_params=params.to_sparse_dict())
    return out


def checked_body(raw: bytes, path: str, max_prompt_chars: int | None) -> dict[str, Any]:
    """The client's JSON body after the checks that need neither tokenizer nor engine, before
    any leg is sent: a request an instance would refuse must not cost a prefill and a held
    lease first. Raises APIError. Module-level: the body parser's worker process runs it."""
    check_body_size(len(raw), max_prompt_chars, path)
    body = parse_json_body(raw)  # not JSON, not an object, too deep, lone surrogate, 1e309
    if not isinstance(body.get("stream", False), bool):
        raise APIError(400, "stream must be a boolean", code="invalid_value", param="stream")
    parse = parse_chat_request if path.endswith("/chat/completions") else parse_completion_request
    parsed = parse({k: v for k, v in body.items() if k != "kv_transfer_params"})
    check_prompt_size(parsed, max_prompt_chars)
    return body


def refusal_of(exc: Exception) -> Refusal | None:
    """An APIError as a picklable refusal (None for any other error: a bug, raised as is)."""
    return (exc.status, exc.message, exc.param, exc.code) if isinstance(exc, APIError) else None


def api_error_of(refusal: Refusal) -> APIError:
    status, message, param, code = refusal
    return APIError(status, message, param=param, code=code)


def make_body_parser() -> BodyParser:
    """The router's parser of client bodies (start() it with the app)."""
    return BodyParser(checked_body, refusal_of, api_error_of)


async def parse_call(
    request: web.Request,
    request_id: str,
    max_prompt_chars: int | None = None,
    parser: BodyParser | None = None,
) -> Call:
    """The client's request, checked (RouteError when it is refused). Text and chat prompts
    over `max_prompt_chars` characters (None: no bound) are refused before any leg. Without
    a started `parser`, a big body is parsed on a thread (holding the GIL meanwhile)."""
    raw = await request.read()
    try:
        if parser is not None:
            body = await parser.parse(raw, request.path, max_prompt_chars)
        elif len(raw) > INLINE_PARSE_BYTES:
            body = await asyncio.to_thread(checked_body, raw, request.path, max_prompt_chars)
        else:
            body = checked_body(raw, request.path, max_prompt_chars)
    except APIError as exc:
        raise RouteError.of(exc.status, exc.message, param=exc.param, code=exc.code) from exc
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
