"""Per-instance HTTP app: OpenAI-compatible generation endpoints, plus the instance's own
(/health, /load, /kv_info, /metrics, /v1/models, POST /v1/abort: instance_routes.py).

Owns a request's life at the HTTP boundary: validate, tokenize, submit, stream, and abort the engine
request on every exit but a normal finish (client gone, stop string, failure). Must not do engine
work or block the event loop; it only talks to the engine through `EngineClient`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from disagg.config import BODY_TIMEOUT_S, HEADER_TIMEOUT_S
from disagg.protocol import RequestOutput
from disagg.security.call_guard import Identity
from disagg.security.http_guard import GuardedRunner, body_deadline_middleware
from disagg.server.engine_client import EngineClient
from disagg.server.generation import Generation, Submit
from disagg.server.instance_routes import InstanceRoutes
from disagg.server.json_body import parse_json_body
from disagg.server.metrics import ServerMetrics
from disagg.server.openai_api import (
    APIError,
    GenerateRequest,
    error_body,
    make_sampling_params,
    parse_chat_request,
    parse_completion_request,
    status_code_name,
)
from disagg.server.openai_responses import (
    ResponseMeta,
    sse_event,
    usage_chunk,
)
from disagg.server.output_processor import OutputProcessor, TextDelta
from disagg.server.prompt_limits import (
    check_body_size,
    check_prompt_size,
    prompt_char_limit,
    prompt_chars,
    resolve_max_tokens,
)
from disagg.server.security import is_cluster_call, make_auth_middleware
from disagg.server.tokenizer import Tokenizer

__all__ = ["make_app", "start_server"]

logger = logging.getLogger(__name__)

_MAX_BODY_BYTES = 16 * 1024 * 1024  # long token-id prompts; aiohttp's default is 1 MiB
# Bodies and prompts above these sizes are parsed / tokenized on a worker thread: a multi-MB
# JSON parse on the event loop stalled /health long enough for the router to drop us.
_INLINE_PARSE_BYTES = 256 * 1024
_INLINE_TOKENIZE_CHARS = 64 * 1024
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

Parse = Callable[[Mapping[str, Any]], GenerateRequest]
Emit = Callable[[TextDelta], Awaitable[None]]


def make_app(
    engine: EngineClient,
    tokenizer: Tokenizer,
    *,
    extra_routes: Sequence[web.RouteDef] = (),
    api_key: str = "",
    cluster_token: str = "",
    identity: Identity | None = None,
    max_request_bytes: int = _MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
    max_prompt_chars: int = 0,
) -> web.Application:
    """The instance's app. Serve it with `start_server` (or any runner created with
    handler_cancellation=True, so a client that goes away cancels its handler).

    `cluster_token` opens the internal routes to calls signed with it (without one they are
    off), each call signed for this instance (its `identity`, besides the address the call
    reaches; see security/call_guard.py) and used once; `api_key` closes the OpenAI API to clients
    without it. Bodies over `max_request_bytes` are refused with 413 before they are read
    whole, bodies not received within `body_timeout_s` with 408. Text and chat prompts over
    `max_prompt_chars` characters (0: the engine's max_model_len x PROMPT_CHARS_PER_TOKEN)
    are refused with 400 before they are tokenized."""
    metrics = ServerMetrics(engine)
    server = _Server(engine, tokenizer, metrics, max_prompt_chars)
    auth_middleware = make_auth_middleware(
        api_key=api_key, cluster_token=cluster_token, identity=identity
    )
    # The body is read before auth: a signature check needs it, and it must be bounded too.
    middlewares = [_error_middleware, body_deadline_middleware(body_timeout_s), auth_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=max_request_bytes)
    app.add_routes(
        [
            web.post("/v1/completions", server.completions),
            web.post("/v1/chat/completions", server.chat_completions),
            *InstanceRoutes(engine, metrics).routes(),
        ]
    )
    app.add_routes(extra_routes)
    return app


async def start_server(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout_s: float = 5.0,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0 = a free port); returns the runner (call `cleanup()` to stop) and
    the bound port. Handler cancellation is on: it is how a vanished client aborts its request.
    A connection that has not sent a request's headers within `header_timeout_s` is closed.
    With `ssl_context` the port speaks HTTPS only (internal TLS, disagg.security.tls)."""
    runner = GuardedRunner(
        app,
        header_timeout_s=header_timeout_s,
        error_body=_parser_error_body,
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound_port = int(runner.addresses[0][1])
    return runner, bound_port


@web.middleware
async def _error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure leaves in the OpenAI error shape, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except APIError as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = APIError(exc.status, exc.reason, code=status_code_name(exc.status))
        allow = exc.headers.get("Allow")
        return _error_response(error, headers={"Allow": allow} if allow else None)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(APIError(500, "internal server error", code="internal_error"))


def _error_response(exc: APIError, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def _parser_error_body(status: int, message: str) -> dict[str, Any]:
    """A request aiohttp's HTTP parser refused (bad request line, header over its limit)."""
    return error_body(status, message, code="bad_request" if status < 500 else "internal_error")


class _Server:
    """Route handlers over one engine and one tokenizer."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        metrics: ServerMetrics,
        max_prompt_chars: int,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._max_prompt_chars = max_prompt_chars  # 0 = derived from the engine's context

    @property
    def max_prompt_chars(self) -> int:
        return self._max_prompt_chars or prompt_char_limit(self._engine.max_model_len)

    # ---- OpenAI generation ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion_request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat_request)

    async def _generate(self, request: web.Request, parse: Parse) -> web.StreamResponse:
        arrival_s = time.monotonic()
        req = await self._parse(await request.read(), request.path, parse)
        if req.kv_transfer_params is not None and not is_cluster_call(request):
            raise APIError(
                403,
                "kv_transfer_params may only be set by the router (a cluster-signed call)",
                code="forbidden",
                param="kv_transfer_params",
            )
        if req.model is not None and req.model != self._engine.model_name:
            raise APIError(
                404, f"model {req.model!r} does not exist", code="model_not_found", param="model"
            )
        if prompt_chars(req) > _INLINE_TOKENIZE_CHARS:
            prompt_ids = await asyncio.to_thread(self._prompt_ids, req)
        else:
            prompt_ids = self._prompt_ids(req)
        max_tokens = resolve_max_tokens(req, len(prompt_ids), self._engine.max_model_len)
        sampling = make_sampling_params(req, max_tokens)
        meta = ResponseMeta(_request_id(request), self._engine.model_name, int(time.time()))
        run = Generation(
            meta=meta,
            request=req,
            num_prompt_tokens=len(prompt_ids),
            processor=OutputProcessor(self._tokenizer, prompt_ids, sampling.stop),
            arrival_s=arrival_s,
        )

        def submit() -> AsyncIterator[RequestOutput]:
            args = (meta.request_id, prompt_ids, sampling, req.kv_transfer_params)
            return self._engine.generate(*args)

        if req.stream:
            return await self._stream(request, run, submit)
        return await self._complete(run, submit)

    async def _parse(self, raw: bytes, path: str, parse: Parse) -> GenerateRequest:
        """Body -> validated request whose prompt is small enough to tokenize. A big body is
        parsed on a worker thread: walking a long token-id list holds the GIL, in bytecode
        that lets the event loop in between. A body too big to hold an acceptable prompt is
        refused unparsed: json.loads holds the GIL (and stalls the engine loop) throughout."""
        check_body_size(len(raw), self.max_prompt_chars, path)
        if len(raw) > _INLINE_PARSE_BYTES:
            return await asyncio.to_thread(self._parse_now, raw, parse)
        return self._parse_now(raw, parse)

    def _parse_now(self, raw: bytes, parse: Parse) -> GenerateRequest:
        req = parse(parse_json_body(raw))
        check_prompt_size(req, self.max_prompt_chars, self._engine.max_model_len)
        return req

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            vocab_size = self._tokenizer.vocab_size
            bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
            if bad:
                message = f"token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}"
                raise APIError(400, message, code="invalid_value", param="prompt")
            return req.prompt_token_ids
        if req.messages is not None:
            try:
                text = self._tokenizer.apply_chat_template(req.messages, req.add_generation_prompt)
            except ValueError as exc:
                raise APIError(400, str(exc), code="invalid_value", param="messages") from exc
            ids = self._tokenizer.encode(text, add_special_tokens=False)  # the template has BOS
        else:
            assert req.prompt is not None, "parser guarantees prompt or prompt_token_ids"
            ids = self._tokenizer.encode(req.prompt)
        if not ids:
            raise APIError(400, "prompt is empty after tokenization", code="invalid_value")
        return ids

    async def _complete(self, run: Generation, submit: Submit) -> web.Response:
        await self._drive(run, submit, _ignore)
        return web.json_response(run.body(), headers={"X-Request-Id": run.meta.request_id})

    async def _stream(
        self, request: web.Request, run: Generation, submit: Submit
    ) -> web.StreamResponse:
        # Headers go out with the first engine output, so a refusal can still be a plain 4xx/503.
        response = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": run.meta.request_id})

        async def emit(step: TextDelta) -> None:
            if not response.prepared:
                await response.prepare(request)
            if (chunk := run.chunk(step)) is not None:
                await response.write(sse_event(chunk))

        try:
            await self._stream_body(response, run, submit, emit)
        except ConnectionResetError:
            logger.info("%s: client went away mid-stream", run.meta.request_id)
        return response

    async def _stream_body(
        self, response: web.StreamResponse, run: Generation, submit: Submit, emit: Emit
    ) -> None:
        try:
            await self._drive(run, submit, emit)
        except APIError as exc:
            if not response.prepared:
                raise  # nothing sent yet: the middleware answers with a plain error status
            await response.write(sse_event(exc.body()))
        else:
            if run.request.include_usage:
                chunk = usage_chunk(run.meta, run.request.is_chat, run.usage())
                await response.write(sse_event(chunk))
        await response.write(sse_event("[DONE]"))
        await response.write_eof()

    async def _drive(self, run: Generation, submit: Submit, emit: Emit) -> None:
        """Feed engine outputs through the processor to `emit` until the request finishes.

        Raises APIError for refusals and failures. On every exit except a finish the engine
        reported itself (cancellation when the client left, a write error, a stop string, an
        error), the engine request is aborted so its blocks are freed."""
        outcome = "abort"  # what metrics record if we leave without a finish reason
        outputs: AsyncIterator[RequestOutput] | None = None
        try:
            outputs = run.submit(submit)
            while (output := await run.next_output(outputs)) is not None:
                step = run.process(output)
                if step.finish_reason == "error":
                    raise APIError(500, step.error or "request failed", code="request_failed")
                await emit(step)
                if step.finish_reason is not None:
                    return
            raise APIError(500, "engine ended the request without a finish", code="internal_error")
        except APIError:
            outcome = "error"
            raise
        finally:
            await self._end(run, outputs, outcome)

    async def _end(
        self, run: Generation, outputs: AsyncIterator[RequestOutput] | None, outcome: str
    ) -> None:
        try:
            if not (run.is_engine_finished or run.is_refused or outputs is None):
                # Shielded: this often runs in a handler that was just cancelled (client gone).
                await asyncio.shield(self._engine.abort(run.meta.request_id))
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            # Recorded even when a second cancellation lands in the awaits above (aiohttp fails
            # a blocked write with ConnectionResetError, then cancels the handler too).
            last = run.last_output
            self._metrics.observe_finished(
                finish_reason=run.processor.finish_reason or outcome,
                num_prompt_tokens=run.num_prompt_tokens,
                num_output_tokens=run.processor.num_output_tokens,
                arrival_s=run.arrival_s,
                first_token_s=run.first_token_s,
                finish_s=time.monotonic(),
                breakdown=last.breakdown if last is not None else None,
            )


def _request_id(request: web.Request) -> str:
    return request.headers.get("X-Request-Id", "").strip() or f"cmpl-{uuid.uuid4().hex}"


async def _ignore(step: TextDelta) -> None:
    return None
