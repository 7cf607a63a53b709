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
    "ResponseMeta",
    "chat_body",
    "chat_chunk",
    "completion_body",
    "completion_chunk",
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


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def completion_body(
    meta: ResponseMeta, text: str, finish_reason: str, usage: dict[str, int], extra: dict[str, Any]
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(meta, "text_completion"), "choices": [choice], "usage": usage, **extra}


def chat_body(
    meta: ResponseMeta, text: str, finish_reason: str, usage: dict[str, int], extra: dict[str, Any]
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    return {**_head(meta, "chat.completion"), "choices": [choice], "usage": usage, **extra}


def completion_chunk(
    meta: ResponseMeta, text: str, finish_reason: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(meta, "text_completion"), "choices": [choice], **extra}


def chat_chunk(
    meta: ResponseMeta, delta: dict[str, str], finish_reason: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(meta, "chat.completion.chunk"), "choices": [choice], **extra}


def usage_chunk(meta: ResponseMeta, object_name: str, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, just usage."""
    return {**_head(meta, object_name), "choices": [], "usage": usage}


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
