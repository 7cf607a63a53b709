"""The router's body parser: big bodies parsed in a worker process, refusals carried back,
and a dead worker replaced without failing the request.

Regression: a 15 MB prompt parsed on a router thread held the GIL ~40-100 ms, so every stream
the router relayed stalled that long (json.loads does not let other threads in)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from disagg.router.body_parser import INLINE_PARSE_BYTES
from disagg.router.call import checked_body, make_body_parser
from disagg.server.openai_api import APIError
from disagg.server.prompt_limits import body_byte_limit

BIG = INLINE_PARSE_BYTES + 1


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_checked_body_refuses_an_unparseably_big_body_by_its_size() -> None:
    raw = _body(prompt="w" * 40)
    assert checked_body(raw, "/v1/completions", 40)["prompt"] == "w" * 40
    limit = body_byte_limit(10)
    padded = _body(prompt="w", pad="x" * limit)
    with pytest.raises(APIError) as info:
        checked_body(padded, "/v1/chat/completions", 10)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "bytes" in info.value.message


def test_big_bodies_are_parsed_in_another_process_small_ones_here() -> None:
    parser = make_body_parser()
    parser.start()
    try:
        small = _body(prompt="hi")
        assert _run(parser.parse(small, "/v1/completions", None)) == {"prompt": "hi"}
        big = _body(prompt="w" * BIG)
        pids = _run(_worker_pids(parser))
        assert pids and os.getpid() not in pids  # the pool's worker is a child process
        assert _run(parser.parse(big, "/v1/completions", None))["prompt"] == "w" * BIG
    finally:
        parser.close()


async def _worker_pids(parser: Any) -> set[int]:
    await parser.parse(_body(prompt="w" * BIG), "/v1/completions", None)  # worker is up
    return set(parser._pool._processes)  # noqa: SLF001 - the test looks at its own pool


def test_a_refusal_in_the_worker_comes_back_as_the_same_error() -> None:
    parser = make_body_parser()
    parser.start()
    try:
        big = _body(prompt="w" * BIG)
        with pytest.raises(APIError) as info:
            _run(parser.parse(big, "/v1/completions", 1000))
        assert (info.value.status, info.value.param) == (400, "prompt")
        not_json = b"{" + b" " * BIG
        with pytest.raises(APIError) as info:
            _run(parser.parse(not_json, "/v1/completions", None))
        assert info.value.status == 400
    finally:
        parser.close()


def test_a_dead_worker_is_replaced_and_the_body_still_parsed() -> None:
    parser = make_body_parser()
    parser.start()
    try:
        big = _body(prompt="w" * BIG)
        for pid in _run(_worker_pids(parser)):
            os.kill(pid, 9)
        assert _run(parser.parse(big, "/v1/completions", None))["prompt"] == "w" * BIG
        assert _run(parser.parse(big, "/v1/completions", None))["prompt"] == "w" * BIG
    finally:
        parser.close()
