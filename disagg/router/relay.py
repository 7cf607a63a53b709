"""What the client gets back: OpenAI error shapes, SSE framing, the TTFT breakdown merge, and the
relay of an instance's answer to the client, event by event as it arrives.

Must not choose instances nor send legs (legs.py), and never buffers a stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

import aiohttp
from aiohttp import web

from disagg.protocol import TTFTBreakdown
from disagg.server.openai_api import error_body, status_code_name

__all__ = [
    "CLIENT_GONE",
    "BreakdownSource",
    "Leg",
    "Relay",
    "Relayed",
    "RouteError",
    "breakdown_of",
    "error_object",
    "merge_breakdowns",
    "read_all",
]

logger = logging.getLogger(__name__)

Leg = Literal["prefill", "decode", "aggregated"]
BreakdownSource = Callable[[], Awaitable[dict[str, Any] | None]]  # P's breakdown, when known

CLIENT_GONE = 499  # status recorded when the client disconnected (nginx's convention)
_BREAKDOWN_FIELDS = frozenset(f.name for f in fields(TTFTBreakdown))
_DATA = b"data: "


def error_object(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; `code` is a
    string as an instance's is (default: named after the status, `not_found` for 404)."""
    return error_body(status, message, code=code or status_code_name(status), param=param)


class RouteError(Exception):
    """A request that ends in an error answer: status + OpenAI-shaped JSON body."""

    def __init__(self, status: int, body: bytes, *, leg: Leg | None = None) -> None:
        super().__init__(f"{leg or 'router'}: HTTP {status}")
        self.status = status
        self.body = body
        self.leg = leg  # which leg failed; None = the router refused the request itself
        self.unsent = False  # True when the leg never reached its instance (connect failed)

    @classmethod
    def of(
        cls,
        status: int,
        message: str,
        *,
        leg: Leg | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> RouteError:
        body = error_object(status, message, param, code)
        return cls(status, json.dumps(body).encode(), leg=leg)

    @classmethod
    def from_upstream(cls, status: int, body: bytes, content_type: str, leg: Leg) -> RouteError:
        """An instance's error, unchanged when it is JSON; wrapped in the OpenAI shape otherwise."""
        if content_type == "application/json":
            return cls(status, body, leg=leg)
        text = body.decode(errors="replace").strip() or f"{leg} instance answered {status}"
        return cls.of(status, text, leg=leg)

    def to_response(self, request_id: str | None = None) -> web.Response:
        headers = {"X-Request-Id": request_id} if request_id else None
        return web.Response(
            status=self.status, body=self.body, content_type="application/json", headers=headers
        )

    def to_sse(self) -> bytes:
        """The error as the last events of a stream whose headers were already sent."""
        try:
            error = json.loads(self.body)["error"]
        except (ValueError, KeyError, TypeError):
            error = error_object(self.status, self.body.decode(errors="replace"))["error"]
        return _DATA + json.dumps({"error": error}).encode() + b"\n\n" + _DATA + b"[DONE]\n\n"


@dataclass(slots=True)
class Relayed:
    """How a relay to the client ended."""

    response: web.StreamResponse
    status: int  # for metrics: the upstream's, the error's, or CLIENT_GONE
    error: RouteError | None = None  # a leg failed after the response had started


def merge_breakdowns(prefill: Any, decode: Any) -> dict[str, Any]:
    """One TTFT breakdown from P's and D's; D's fields win where both are set."""
    p_raw = prefill if isinstance(prefill, dict) else {}
    d_raw = decode if isinstance(decode, dict) else {}
    p_known = TTFTBreakdown(**{k: v for k, v in p_raw.items() if k in _BREAKDOWN_FIELDS})
    d_known = TTFTBreakdown(**{k: v for k, v in d_raw.items() if k in _BREAKDOWN_FIELDS})
    extra = {k: v for k, v in {**p_raw, **d_raw}.items() if k not in _BREAKDOWN_FIELDS}
    return {**extra, **d_known.merge(p_known).to_dict()}


def breakdown_of(answer: Any) -> dict[str, Any] | None:
    """`answer["disagg"]["breakdown"]` when it is there."""
    disagg = answer.get("disagg") if isinstance(answer, dict) else None
    found = disagg.get("breakdown") if isinstance(disagg, dict) else None
    return found if isinstance(found, dict) else None


def _merge_into(payload: bytes, prefill: dict[str, Any] | None) -> bytes:
    """A JSON document carrying D's breakdown, rewritten to carry the merged one."""
    try:
        obj = json.loads(payload)
    except ValueError:
        return payload
    decode = breakdown_of(obj)
    if decode is None:
        return payload
    obj["disagg"]["breakdown"] = merge_breakdowns(prefill, decode)
    return json.dumps(obj).encode()


async def _merge_event(event: bytes, prefill_breakdown: BreakdownSource) -> bytes:
    if not event.startswith(_DATA) or b'"disagg"' not in event:  # cheap test on every event
        return event
    merged = _merge_into(event[len(_DATA) :].strip(), await prefill_breakdown())
    return _DATA + merged + b"\n\n"


def _split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each ends with a blank line) and the incomplete rest."""
    *events, rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    return [e + b"\n\n" for e in events], rest


async def _read_chunk(resp: aiohttp.ClientResponse, leg: Leg) -> bytes:
    """Next bytes of a leg's body (b"" at the end); an upstream failure becomes RouteError."""
    try:
        return await resp.content.readany()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RouteError.of(502, f"{leg} instance stream broke: {exc!r}", leg=leg) from exc


async def read_all(resp: aiohttp.ClientResponse, leg: Leg) -> bytes:
    parts: list[bytes] = []
    while chunk := await _read_chunk(resp, leg):
        parts.append(chunk)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Relay:
    """The leg that answers the client, relayed to it; P's breakdown is merged into D's when
    `prefill_breakdown` is given."""

    request: web.Request  # the client's, which the answer is written to
    resp: aiohttp.ClientResponse  # the leg's, once its headers came
    leg: Leg
    request_id: str  # the X-Request-Id of the answer
    prefill_breakdown: BreakdownSource | None
    on_first_byte: Callable[[], None]  # called once, when the answer starts

    async def run(self) -> Relayed:
        """Raises RouteError for an upstream error status (passed through) or a failure before
        the answer starts; after that, failures end the stream with an error event
        (`Relayed.error`). Always closes `resp`: unread, that drops the connection, which
        aborts the request upstream."""
        resp = self.resp
        try:
            if resp.status < 400 and resp.content_type == "text/event-stream":
                return await self._stream()
            body = await read_all(resp, self.leg)
            if resp.status >= 400:
                raise RouteError.from_upstream(resp.status, body, resp.content_type, self.leg)
            if self.prefill_breakdown is not None:
                body = _merge_into(body, await self.prefill_breakdown())
            self.on_first_byte()
            headers = {"X-Request-Id": self.request_id}
            out = web.Response(status=resp.status, body=body, headers=headers)
            out.content_type = resp.content_type
            return Relayed(out, resp.status)
        finally:
            resp.close()

    async def _stream(self) -> Relayed:
        headers = {"Cache-Control": "no-cache", "X-Request-Id": self.request_id}
        out = web.StreamResponse(headers=headers)
        out.content_type = "text/event-stream"
        try:
            await out.prepare(self.request)
            self.on_first_byte()
            rest = b""
            while chunk := await _read_chunk(self.resp, self.leg):
                events, rest = _split_events(rest + chunk)
                for event in events:
                    if self.prefill_breakdown is not None:
                        event = await _merge_event(event, self.prefill_breakdown)
                    await out.write(event)
            if rest.strip():
                await out.write(rest + b"\n\n")
            await out.write_eof()
        except RouteError as exc:  # a leg failed mid-stream: end the stream with the error
            logger.warning("request %s: %s leg failed mid-stream", self.request_id, exc.leg)
            return await _end_with_error(out, exc)
        except ConnectionResetError:  # writing to the client failed: it went away
            logger.info("request %s: client disconnected", self.request_id)
            return Relayed(out, CLIENT_GONE)
        return Relayed(out, self.resp.status)


async def _end_with_error(out: web.StreamResponse, error: RouteError) -> Relayed:
    try:
        await out.write(error.to_sse())
        await out.write_eof()
    except ConnectionResetError:
        return Relayed(out, CLIENT_GONE, error)
    return Relayed(out, error.status, error)
