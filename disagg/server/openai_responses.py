"""OpenAI API wire format, responses: completion and chat bodies, stream chunks, SSE framing.

Pure functions over JSON values (no engine, tokenizer or aiohttp), shaped as OpenAI's API and
vLLM's server answer, so unchanged `openai` clients parse them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LogprobEntry",
    "ResponseMeta",
    "chat_logprobs",
    "completion_logprobs",
    "response_body",
    "response_chunk",
    "sse_event",
    "usage_chunk",
    "usage_dict",
]


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """Fields every body and chunk of one response repeats."""

    request_id: str
    model: str
    created: int  # unix seconds, fixed at arrival


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One output token's logprobs with its ids already decoded (the output processor's)."""

    token: str  # the token's own text, decoded alone
    logprob: float | None  # None = unknown (a first token relayed without its logprobs)
    top: list[tuple[str, float]]  # (text, logprob) of the top alternatives, most likely first
    text_offset: int  # characters of completion text before this token's text


def completion_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists. Each top_logprobs dict holds the top
    alternatives plus the sampled token (so up to logprobs + 1 keys, as OpenAI and vLLM)."""
    top: list[dict[str, float] | None] = []
    for entry in entries:
        alternatives = dict(entry.top)
        if entry.logprob is not None:
            alternatives.setdefault(entry.token, entry.logprob)
        top.append(alternatives if entry.logprob is not None else None)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": [e.text_offset for e in entries],
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = [
        {
            **_chat_token(entry.token, entry.logprob),
            "top_logprobs": [_chat_token(token, logprob) for token, logprob in entry.top],
        }
        for entry in entries
    ]
    return {"content": content}


def _chat_token(token: str, logprob: float | None) -> dict[str, Any]:
    # bytes: the UTF-8 of the token text, so clients can rebuild characters split over tokens.
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def response_body(
    meta: ResponseMeta,
    is_chat: bool,
    text: str,
    finish_reason: str,
    usage: dict[str, int],
    extra: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole answer: chat's assistant `message`, or completions' `text`."""
    content = {"message": {"role": "assistant", "content": text}} if is_chat else {"text": text}
    object_name = "chat.completion" if is_chat else "text_completion"
    choice = _choice(content, finish_reason, logprobs)
    return {**_head(meta, object_name), "choices": [choice], "usage": usage, **extra}


def response_chunk(
    meta: ResponseMeta,
    is_chat: bool,
    content: dict[str, Any],
    finish_reason: str | None,
    extra: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stream chunk; `content` is chat's {"delta": {...}} or completions' {"text": ...}."""
    choice = _choice(content, finish_reason, logprobs)
    return {**_head(meta, _chunk_object(is_chat)), "choices": [choice], **extra}


def usage_chunk(meta: ResponseMeta, is_chat: bool, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, just usage."""
    return {**_head(meta, _chunk_object(is_chat)), "choices": [], "usage": usage}


def _chunk_object(is_chat: bool) -> str:
    return "chat.completion.chunk" if is_chat else "text_completion"


def _choice(
    content: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}


def _head(meta: ResponseMeta, object_name: str) -> dict[str, Any]:
    return {
        "id": meta.request_id,
        "object": object_name,
        "created": meta.created,
        "model": meta.model,
    }


def sse_event(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>\\n\\n` (or a literal such as [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
