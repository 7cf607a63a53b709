"""How long a client may hold a connection to an HTTP server of ours (an instance or the router).

Owns the aiohttp runner both apps are served by: a deadline on a request's headers (aiohttp has
none; a dribbling client held its connection for as long as it kept sending), a deadline on its
body (a middleware: every handler reads the body whole, so one read up front bounds them all),
and JSON answers where aiohttp's own HTTP parser would answer in plain text (a header over its
8190-byte limit, a malformed request line). Must not know any route, body format or flow.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

__all__ = ["ErrorBody", "GuardedRunner", "body_deadline_middleware"]

logger = logging.getLogger(__name__)

ErrorBody = Callable[[int, str], dict[str, Any]]  # (status, message) -> the app's error JSON

# Idle time between requests on a kept-alive connection (aiohttp's default is an hour). Longer
# than aiohttp's client pool keeps a connection (15 s), so the router's pooled legs to an
# instance are never closed under it by the instance.
KEEPALIVE_S = 75.0
# After a refusal (408, 413) aiohttp reads and drops what the client is still sending, so that
# the client sees the answer rather than a reset; a client still dribbling gets no longer.
LINGER_S = 2.0


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections get `header_timeout_s` to send each request's headers:
    from the connection's opening for the first request, and from its first byte for each later
    one (waiting between requests is idle time, bounded by KEEPALIVE_S). Parser errors are
    answered with `error_body`'s JSON."""

    def __init__(
        self, app: web.Application, *, header_timeout_s: float, error_body: ErrorBody, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._error_body = error_body

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts the app; its handler and request factory
        return _GuardedServer(plain, self._header_timeout_s, self._error_body)


class _GuardedServer(web.Server):
    """The app's low-level server, making _GuardedHandler connections."""

    def __init__(self, plain: web.Server, header_timeout_s: float, error_body: ErrorBody) -> None:
        self._handler_kwargs: dict[str, Any] = {
            "access_log": None,
            "keepalive_timeout": KEEPALIVE_S,
            "lingering_time": LINGER_S,
        }
        super().__init__(
            plain.request_handler,
            request_factory=_noting_headers_read(plain.request_factory),
            handler_cancellation=plain.handler_cancellation,
            **self._handler_kwargs,
        )
        self._header_timeout_s = header_timeout_s
        self._error_body = error_body

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(
            self,
            loop=asyncio.get_running_loop(),
            header_timeout_s=self._header_timeout_s,
            error_body=self._error_body,
            **self._handler_kwargs,
        )


def _noting_headers_read(make_request: Any) -> Any:
    """The request factory, telling the connection first: it is called once a request's
    headers are parsed (or failed to parse), before its handler runs."""

    def make(message: Any, payload: Any, protocol: Any, *args: Any) -> web.BaseRequest:
        protocol.on_headers_read()
        return make_request(message, payload, protocol, *args)

    return make


class _GuardedHandler(RequestHandler):
    """One connection: aiohttp's handler plus the header deadline and JSON parser errors."""

    __slots__ = ("_header_timeout_s", "_error_body", "_is_awaiting_headers", "_header_timer")

    def __init__(
        self,
        manager: web.Server,
        *,
        header_timeout_s: float,
        error_body: ErrorBody,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._error_body = error_body
        self._is_awaiting_headers = True  # False from a request's headers to its response's end
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_header_timer()  # a client that connects and sends nothing counts too

    def data_received(self, data: bytes) -> None:
        if data and self._is_awaiting_headers and self._header_timer is None:
            self._start_header_timer()  # the first byte of a later request
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_headers_read(self) -> None:
        self._is_awaiting_headers = False
        self._cancel_header_timer()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._is_awaiting_headers = True  # what the client sends next starts a request

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused (or a handler crash that escaped
        the app's middleware), in the app's JSON error shape instead of plain text."""
        super().handle_error(request, status, exc, message)  # logs; raises if an answer began
        text = message.strip() if message and status < 500 else HTTPStatus(status).phrase
        response = web.json_response(self._error_body(status, text), status=status)
        response.force_close()  # the stream may be mid-request: never reuse it
        return response

    def _start_header_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._header_timer = loop.call_later(self._header_timeout_s, self._on_header_deadline)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_deadline(self) -> None:
        self._header_timer = None
        if self._is_awaiting_headers:
            logger.debug("closing a connection: no request headers within %g s",
                         self._header_timeout_s)  # fmt: skip
            self.force_close()


def body_deadline_middleware(timeout_s: float) -> Any:
    """Reads a request's body whole within `timeout_s` before its handler runs (aiohttp keeps
    it, so the handler's own read is free); past the deadline, 408. Place it inside the app's
    error middleware, which turns the 408 (and a 413 from the size limit) into its JSON."""

    @web.middleware
    async def read_body_in_time(
        request: web.Request, handler: aiohttp.typedefs.Handler
    ) -> web.StreamResponse:
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                logger.info("%s %s: request body not received within %g s",
                            request.method, request.path, timeout_s)  # fmt: skip
                raise web.HTTPRequestTimeout() from None
        return await handler(request)

    return read_body_in_time
