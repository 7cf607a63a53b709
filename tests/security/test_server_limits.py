"""How long a client may hold an HTTP connection it does not finish, on instances and the router.

An adversarial run held 100 slowloris connections (headers dribbled a line at a time) and endless
chunked uploads open for a minute on both servers, and got aiohttp's plain-text 400 for a header
over 8 KB. Each test plays one of those against a real server on loopback, with short deadlines:
the connection must be closed (or answered 408) soon after its deadline, and every refusal must
be JSON in the OpenAI error shape. Clients that are slow but within the deadlines still get served.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from disagg.config import RouterConfig, ServerConfig
from disagg.router.app import make_app as make_router_app
from disagg.router.app import start_server as start_router
from disagg.server.app import make_app as make_instance_app
from disagg.server.app import start_server as start_instance
from disagg.server.tokenizer import Tokenizer
from tests.router.fakes import run_async
from tests.server.fakes import ScriptedEngine, make_tokenizer_dir

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
CLOSED_WITHIN_S = 6.0  # deadline + the 2 s linger + slack for a busy machine
NUM_SLOWLORIS = 20
BIG_HEADER = b"X-Big: " + b"a" * 9000 + b"\r\n"  # past aiohttp's 8190-byte field limit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


Serve = Callable[[], Any]  # -> an async context manager yielding (host, port)


@pytest.fixture(params=["instance", "router"])
def serve(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> Serve:
    """Either server, with the short deadlines; the router fronts a decode URL nobody serves."""

    @asynccontextmanager
    async def running() -> AsyncIterator[tuple[str, int]]:
        if request.param == "instance":
            app = make_instance_app(
                ScriptedEngine(output_ids=[5, 6]), tokenizer, body_timeout_s=BODY_TIMEOUT_S
            )
            runner, port = await start_instance(
                app, "127.0.0.1", 0, header_timeout_s=HEADER_TIMEOUT_S
            )
        else:
            cfg = RouterConfig(decode_urls=("http://127.0.0.1:9",), body_timeout_s=BODY_TIMEOUT_S)
            runner, port = await start_router(
                make_router_app(cfg), "127.0.0.1", 0, header_timeout_s=HEADER_TIMEOUT_S
            )
        try:
            yield "127.0.0.1", port
        finally:
            await runner.cleanup()

    return running


async def _read_until_closed(reader: asyncio.StreamReader, limit_s: float) -> bytes:
    """Everything the server sends until it closes; TimeoutError if it is still open."""
    data = b""
    async with asyncio.timeout(limit_s):
        while chunk := await _read_some(reader):
            data += chunk
    return data


async def _read_some(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read(65536)
    except ConnectionError:  # a reset is a close too
        return b""


async def _keep_writing(writer: asyncio.StreamWriter, first: bytes, each: bytes) -> None:
    """`first`, then `each` every 0.1 s until the server stops taking them."""
    try:
        writer.write(first)
        while True:
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(each)
    except ConnectionError:
        return


def _parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    length = int(headers.get("Content-Length", len(body)))
    return int(lines[0].split()[1]), headers, json.loads(body[:length])


def _assert_openai_error(headers: dict[str, str], body: Any) -> str:
    assert headers["Content-Type"].startswith("application/json"), headers
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return str(body["error"]["message"])


def _error_status(raw: bytes) -> int:
    """The status of an answer that must be an OpenAI-shaped JSON error."""
    status, headers, body = _parse_response(raw)
    _assert_openai_error(headers, body)
    return status


async def _closed_while_writing(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes, each: bytes
) -> bytes:
    """Write `first`, then `each` every 0.1 s, until the server closes (within
    CLOSED_WITHIN_S): everything it sent. The writer is closed on return."""
    writing = asyncio.create_task(_keep_writing(writer, first, each))
    try:
        return await _read_until_closed(reader, CLOSED_WITHIN_S)
    finally:
        writing.cancel()
        writer.close()


async def _head_after_pieces(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pieces: list[bytes], pause_s: float
) -> bytes:
    """Send `pieces`, each followed by `pause_s` of silence; the head of the answer."""
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(pause_s)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    return head


async def _answer_to(host: str, port: int, request: bytes) -> bytes:
    """Send `request` on a new connection; everything the server sent until it closed."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    raw = await _read_until_closed(reader, CLOSED_WITHIN_S)
    writer.close()
    return raw


async def _slowloris(host: str, port: int) -> float:
    """Dribble header lines forever; seconds until the server hangs up."""
    started_s = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    first = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
    await _closed_while_writing(reader, writer, first, b"X-Slow: 1\r\n")
    return time.monotonic() - started_s


def test_slowloris_connections_are_closed_at_the_header_deadline(serve: Serve) -> None:
    """Regression: 100 dribbling connections were all still open after 60 s."""

    async def scenario() -> None:
        async with serve() as (host, port):
            held_s = await asyncio.gather(*(_slowloris(host, port) for _ in range(NUM_SLOWLORIS)))
            assert max(held_s) < CLOSED_WITHIN_S

    run_async(scenario(), timeout_s=30)


def test_a_silent_connection_is_closed_at_the_header_deadline(serve: Serve) -> None:
    async def scenario() -> None:
        async with serve() as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                assert await _read_until_closed(reader, CLOSED_WITHIN_S) == b""
            finally:
                writer.close()

    run_async(scenario())


def test_header_deadline_covers_later_requests_on_a_kept_alive_connection(serve: Serve) -> None:
    async def scenario() -> None:
        async with serve() as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
            await asyncio.sleep(2 * HEADER_TIMEOUT_S)  # idle between requests is not late
            await _closed_while_writing(
                reader, writer, b"GET /health HTTP/1.1\r\n", b"X-Slow: 1\r\n"
            )

    run_async(scenario())


def test_headers_sent_in_pieces_within_the_deadline_are_served(serve: Serve) -> None:
    async def scenario() -> None:
        async with serve() as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            pieces = [b"GET /metrics HTTP/1.1\r\n", b"Host: t\r\n", b"\r\n"]
            head = await _head_after_pieces(reader, writer, pieces, HEADER_TIMEOUT_S / 10)
            assert head.startswith(b"HTTP/1.1 200"), head

    run_async(scenario())


def test_an_endless_chunked_upload_gets_408_at_the_body_deadline(serve: Serve) -> None:
    """Regression: a chunked body that never ends held its connection for 60 s."""

    async def scenario() -> None:
        async with serve() as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
            first = head + b"\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
            raw = await _closed_while_writing(reader, writer, first, b"1\r\n \r\n")
            assert _error_status(raw) == 408, raw[:300]

    run_async(scenario())


def test_a_slow_body_within_the_deadline_is_read(serve: Serve) -> None:
    async def scenario() -> None:
        async with serve() as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            body = b'{"prompt": [1, 2, 3], "max_tokens": -1}'  # a 400 proves it was parsed
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
            writer.write(
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            head = await _head_after_pieces(
                reader, writer, [body[:10], body[10:]], BODY_TIMEOUT_S / 10
            )
            assert head.startswith(b"HTTP/1.1 400"), head

    run_async(scenario())


def test_a_header_over_the_limit_gets_a_json_400(serve: Serve) -> None:
    """Regression: aiohttp's low-level parser answered this in plain text."""

    async def scenario() -> None:
        async with serve() as (host, port):
            request = b"GET /health HTTP/1.1\r\nHost: t\r\n" + BIG_HEADER + b"\r\n"
            raw = await _answer_to(host, port, request)
            status, headers, body = _parse_response(raw)
            assert status == 400, raw[:300]
            assert "8190" in _assert_openai_error(headers, body)  # the message names the limit

    run_async(scenario())


def test_a_malformed_request_line_gets_a_json_400(serve: Serve) -> None:
    async def scenario() -> None:
        async with serve() as (host, port):
            raw = await _answer_to(host, port, b"GET /health HTTP/1.1 extra\r\nHost: t\r\n\r\n")
            assert _error_status(raw) == 400, raw[:300]

    run_async(scenario())


def test_deadlines_must_be_positive() -> None:
    with pytest.raises(ValueError, match="header_timeout_s"):
        RouterConfig(decode_urls=("http://127.0.0.1:9",), header_timeout_s=0)
    with pytest.raises(ValueError, match="body_timeout_s"):
        RouterConfig(decode_urls=("http://127.0.0.1:9",), body_timeout_s=-1)
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServerConfig(header_timeout_s=0)
    with pytest.raises(ValueError, match="body_timeout_s"):
        ServerConfig(body_timeout_s=0)
