"""Logprobs on the OpenAI API: parsing and validation (400 naming the field), the response
shapes of both endpoints, and the live app over a ScriptedEngine, streamed and not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from disagg.protocol import FinishReason, RequestOutput, TokenLogprobs
from disagg.server.openai_api import APIError, parse_chat_request, parse_completion_request
from disagg.server.openai_responses import LogprobEntry, chat_logprobs, completion_logprobs
from disagg.server.output_processor import OutputProcessor
from disagg.server.tokenizer import Tokenizer
from tests.server.conftest import OUTPUT_TEXT
from tests.server.fakes import ScriptedEngine, ServerThread
from tests.server.test_app import _client, _post, _sse

Serve = Callable[..., tuple[ScriptedEngine, ServerThread]]
MESSAGES = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(("value", "want"), [(None, None), (0, 0), (5, 5), (20, 20)])
def test_completion_logprobs_count(value: int | None, want: int | None) -> None:
    body = {"prompt": "a"} if value is None else {"prompt": "a", "logprobs": value}
    assert parse_completion_request(body).sampling.logprobs == want


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 7}, 7),
        ({"logprobs": True, "top_logprobs": 0}, 0),
    ],
)
def test_chat_logprobs_flag_and_count(extra: dict[str, Any], want: int | None) -> None:
    assert parse_chat_request({"messages": MESSAGES, **extra}).sampling.logprobs == want


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_completion_request, {"prompt": "a", "logprobs": 21}, "logprobs"),
        (parse_completion_request, {"prompt": "a", "logprobs": -1}, "logprobs"),
        (parse_completion_request, {"prompt": "a", "logprobs": 1.5}, "logprobs"),
        (parse_completion_request, {"prompt": "a", "logprobs": True}, "logprobs"),
        (parse_completion_request, {"prompt": "a", "logprobs": "2"}, "logprobs"),
        (parse_chat_request, {"messages": MESSAGES, "logprobs": 1}, "logprobs"),
        (parse_chat_request, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (
            parse_chat_request,
            {"messages": MESSAGES, "logprobs": False, "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            parse_chat_request,
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            parse_chat_request,
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1},
            "top_logprobs",
        ),
    ],
)
def test_bad_logprobs_are_400_naming_the_field(parse: Any, body: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        parse(body)
    error = caught.value.body()["error"]
    assert caught.value.status == 400 and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"


# ---------------------------------------------------------------------------- shapes

ENTRIES = [
    LogprobEntry("Hi", -0.5, [("Hi", -0.5), ("Yo", -1.5)], 0),
    LogprobEntry(" é", -2.0, [("!", -0.25)], 2),  # sampled token outside the top 1
    LogprobEntry("?", None, [], 4),  # unknown (relayed without logprobs)
]


def test_completion_shape_is_legacy_parallel_lists() -> None:
    assert completion_logprobs(ENTRIES) == {
        "tokens": ["Hi", " é", "?"],
        "token_logprobs": [-0.5, -2.0, None],
        "top_logprobs": [{"Hi": -0.5, "Yo": -1.5}, {"!": -0.25, " é": -2.0}, None],
        "text_offset": [0, 2, 4],
    }


def test_chat_shape_has_bytes_and_nested_top() -> None:
    content = chat_logprobs(ENTRIES)["content"]
    assert content[0] == {
        "token": "Hi",
        "logprob": -0.5,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
            {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
        ],
    }
    assert content[1]["bytes"] == list(" é".encode())
    assert content[2] == {"token": "?", "logprob": None, "bytes": [63], "top_logprobs": []}


def test_output_processor_decodes_ids_and_offsets(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    processor = OutputProcessor(tokenizer, [], stop=())
    given = [TokenLogprobs(-0.5, [t], [-0.5]) for t in ids]
    delta = processor.process(RequestOutput("r", ids, FinishReason.STOP, new_logprobs=given))
    assert delta.logprobs is not None
    assert "".join(e.token for e in delta.logprobs) == "Hello world"
    offsets = [e.text_offset for e in delta.logprobs]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert all(e.top[0][0] == e.token for e in delta.logprobs)


def test_output_processor_without_logprobs_gives_none(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer, [], stop=())
    delta = processor.process(RequestOutput("r", [5], FinishReason.STOP))
    assert delta.logprobs is None


# ---------------------------------------------------------------------------- live app


def test_completion_logprobs_non_stream(serve: Serve, tokenizer: Tokenizer) -> None:
    engine, server = serve()
    choice = (
        _client(server)
        .completions.create(model="fake-model", prompt="Paris", max_tokens=5, logprobs=3)
        .choices[0]
    )
    assert engine.submitted[0].sampling.logprobs == 3
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == 5
    assert logprobs.token_logprobs == [-0.125] * 5
    assert all(
        len(top) == 3 and top[tok] == -0.125
        for tok, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
    )
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset[0] == 0


def test_chat_logprobs_non_stream(serve: Serve) -> None:
    engine, server = serve()
    choice = (
        _client(server)
        .chat.completions.create(
            model="fake-model", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2
        )
        .choices[0]
    )
    assert engine.submitted[0].sampling.logprobs == 2
    content = choice.logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == choice.message.content
    assert content[0].bytes == list(content[0].token.encode())


def test_without_logprobs_the_field_is_null(serve: Serve) -> None:
    engine, server = serve()
    for path, body in (
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logprobs": False}),
    ):
        assert _post(server, path, body).json()["choices"][0]["logprobs"] is None
        stream = _sse(_post(server, path, {**body, "stream": True}))
        assert all(e["choices"][0]["logprobs"] is None for e in stream[:-1])
    assert all(s.sampling.logprobs is None for s in engine.submitted)  # nothing asked of it


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_carry_their_tokens_logprobs(serve: Serve, path: str) -> None:
    """Every output token's logprobs arrive exactly once, on the chunk with (or before the
    release of) its text, and together they spell the streamed text."""
    _, server = serve()
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": "Paris", "logprobs": 1}
    else:
        body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1}
    events = _sse(_post(server, path, {**body, "max_tokens": 50, "stream": True}))
    chunks = [e["choices"][0] for e in events[:-1]]
    if path == "/v1/completions":
        tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
        text = "".join(c["text"] for c in chunks)
    else:
        tokens = [t["token"] for c in chunks for t in c["logprobs"]["content"]]
        text = "".join(c["delta"].get("content", "") for c in chunks)
    assert text == OUTPUT_TEXT and "".join(tokens) == OUTPUT_TEXT
    assert len(chunks) > 1  # streamed, not one chunk


def test_openai_client_sees_the_param_of_bad_logprobs(serve: Serve) -> None:
    _, server = serve()
    with pytest.raises(openai.BadRequestError) as caught:
        _client(server).completions.create(model="fake-model", prompt="a", logprobs=21)
    assert caught.value.body["param"] == "logprobs"
