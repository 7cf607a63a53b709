"""OpenAI API wire format, requests: validate parsed bodies (responses: openai_responses.py).

Owns the error shape and every 4xx decision over a body's fields that needs neither tokenizer
nor engine (the app checks vocabulary and context length), the bounds on stop strings and stop
ids among them. The bytes are parsed by json_body.py and the prompt's size is bounded by
prompt_limits.py. Must not touch the engine, the tokenizer or aiohttp: pure functions over JSON
values, so the router can reuse them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from disagg.protocol import MAX_LOGPROBS, KVTransferParams, SamplingParams

__all__ = [
    "MAX_NUM_STOP",
    "MAX_NUM_STOP_TOKEN_IDS",
    "MAX_STOP_CHARS",
    "APIError",
    "GenerateRequest",
    "error_body",
    "make_sampling_params",
    "parse_chat_request",
    "parse_completion_request",
    "status_code_name",
]

# Per-token work grows with these lists (stop strings are matched against every new piece of
# text, stop ids against every sampled token). OpenAI takes 4 stop strings; vLLM sets no bound.
MAX_NUM_STOP = 16
MAX_STOP_CHARS = 256  # stop strings are markers ("</s>", "\nUser:"), not passages
MAX_NUM_STOP_TOKEN_IDS = 1024  # above any model's special tokens (Llama 3 reserves 256)
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Parameters we accept only at their no-op value: silently ignoring them would change the output.
_NOOP_VALUES: dict[str, object] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
}


class APIError(Exception):
    """A request that fails with an HTTP status and the OpenAI error shape."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def status_code_name(status: int) -> str | None:
    """The error `code` of a refusal without a more specific one: `not_found` for 404, None
    for a status HTTP does not name. OpenAI's codes are strings, never the status number."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return None
    return phrase.lower().replace(" ", "_").replace("-", "_")


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}} as OpenAI returns it (its 404 for an
    unknown model is an invalid_request_error too; `code` tells the cases apart)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions body (prompt not yet tokenized)."""

    is_chat: bool
    model: str | None  # None = whatever this server serves
    prompt: str | None = None  # completions, text form
    prompt_token_ids: list[int] | None = None  # completions, token form (ids not yet range-checked)
    messages: list[dict[str, str]] | None = None  # chat; content flattened to one string
    add_generation_prompt: bool = True
    max_tokens: int | None = (
        None  # None = endpoint default, resolved once the prompt length is known
    )
    sampling: SamplingParams  # validated; its max_tokens is a placeholder until resolved
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    kv_transfer_params: KVTransferParams | None = None


def parse_completion_request(body: Mapping[str, Any]) -> GenerateRequest:
    _reject_unsupported(body)
    if body.get("echo"):
        raise _unsupported("echo")
    if body.get("suffix") is not None:
        raise _unsupported("suffix")
    prompt, prompt_token_ids = _parse_prompt(body.get("prompt"))
    return GenerateRequest(
        is_chat=False,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        max_tokens=_max_tokens(body, "max_tokens"),
        **_common_fields(body, _logprobs_count(body, "logprobs")),
    )


def parse_chat_request(body: Mapping[str, Any]) -> GenerateRequest:
    _reject_unsupported(body)
    if body.get("tools"):
        raise _unsupported("tools")
    if body.get("continue_final_message"):
        raise _unsupported("continue_final_message")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _unsupported("response_format")
    max_tokens = _max_tokens(body, "max_completion_tokens")
    add_generation_prompt = _opt_bool(body, "add_generation_prompt")
    return GenerateRequest(
        is_chat=True,
        messages=_parse_messages(body.get("messages")),
        add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
        max_tokens=max_tokens if max_tokens is not None else _max_tokens(body, "max_tokens"),
        **_common_fields(body, _chat_logprobs(body)),
    )


def _logprobs_count(body: Mapping[str, Any], name: str) -> int | None:
    """An optional count of top alternatives per token, 0..MAX_LOGPROBS (None = not asked)."""
    value = _opt_int(body, name)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise _bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)
    return value


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat asks with `logprobs: true` and counts alternatives with `top_logprobs` (0 when
    absent); `top_logprobs` alone is refused, as OpenAI and vLLM refuse it."""
    wanted = _opt_bool(body, "logprobs")
    top = _logprobs_count(body, "top_logprobs")
    if top is not None and not wanted:
        raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
    return (top or 0) if wanted else None


def _common_fields(body: Mapping[str, Any], logprobs: int | None) -> dict[str, Any]:
    stream = bool(_opt_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    if options is not None and not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    include_usage = bool(_opt_bool(options or {}, "include_usage"))
    return {
        "model": _opt_str(body, "model"),
        "sampling": _parse_sampling(body, logprobs),
        "stream": stream,
        "include_usage": include_usage,
        "kv_transfer_params": _parse_kv_params(body.get("kv_transfer_params")),
    }


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise _unsupported("n", f"n={n} is not supported (only n=1)")
    best_of = _opt_int(body, "best_of")
    if best_of is not None and best_of > 1:
        raise _unsupported("best_of", f"best_of={best_of} is not supported")
    for name, noop in _NOOP_VALUES.items():
        value = body.get(name)
        if value is not None and value != noop:
            raise _unsupported(name)
    if body.get("logit_bias"):
        raise _unsupported("logit_bias")


def _parse_sampling(body: Mapping[str, Any], logprobs: int | None) -> SamplingParams:
    top_k = _opt_int(body, "top_k")
    fields: dict[str, Any] = {
        "temperature": _opt_number(body, "temperature"),
        "top_p": _opt_number(body, "top_p"),
        "top_k": None if top_k in (None, -1, 0) else top_k,  # -1/0 = disabled, as vLLM
        "seed": _opt_int(body, "seed"),
        "stop": _parse_stop(body.get("stop")),
        "stop_token_ids": _parse_stop_token_ids(body.get("stop_token_ids")),
        "ignore_eos": _opt_bool(body, "ignore_eos"),
        "min_tokens": _opt_int(body, "min_tokens"),
        "logprobs": logprobs,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    return _sampling_or_400(SamplingParams, **given)


def _parse_stop(raw: object) -> tuple[str, ...]:
    stop = [raw] if isinstance(raw, str) else raw
    if stop is None:
        return ()
    if isinstance(stop, list) and len(stop) > MAX_NUM_STOP:
        raise _bad(f"stop may have at most {MAX_NUM_STOP} strings, got {len(stop)}", "stop")
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop must be a non-empty string or a list of non-empty strings", "stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        message = f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}"
        raise _bad(message, "stop")
    return tuple(stop)


def _parse_stop_token_ids(raw: object) -> frozenset[int]:
    if raw is None:
        return frozenset()
    if isinstance(raw, list) and len(raw) > MAX_NUM_STOP_TOKEN_IDS:  # before a walk over it
        message = f"stop_token_ids may have at most {MAX_NUM_STOP_TOKEN_IDS} ids, got {len(raw)}"
        raise _bad(message, "stop_token_ids")
    if not isinstance(raw, list) or not all(type(t) is int for t in raw):
        raise _bad("stop_token_ids must be a list of integers", "stop_token_ids")
    return frozenset(raw)


def _sampling_or_400(factory: Any, **fields: Any) -> SamplingParams:
    try:
        return factory(**fields)
    except (TypeError, ValueError) as exc:
        raise _bad(str(exc)) from exc


def _parse_kv_params(raw: object) -> KVTransferParams | None:
    if raw is None:
        return None
    try:
        return KVTransferParams.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise _bad(str(exc), "kv_transfer_params") from exc


def _parse_prompt(raw: object) -> tuple[str | None, list[int] | None]:
    """Accepted: "text", ["text"], [ids...], [[ids...]]. Several prompts are a batch: 400."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str | list):
        if len(raw) > 1:
            raise _unsupported("prompt", "batched prompts are not supported (send one per request)")
        raw = raw[0]
    if raw is None:
        raise _bad("prompt is required", "prompt")
    if isinstance(raw, str):
        if not raw:
            raise _bad("prompt must not be empty", "prompt")
        return raw, None
    if not isinstance(raw, list) or not all(type(t) is int for t in raw):
        raise _bad("prompt must be a string or a list of token ids", "prompt")
    if not raw:
        raise _bad("prompt must not be empty", "prompt")
    return None, list(raw)


def _parse_messages(raw: object) -> list[dict[str, str]]:
    if raw is None:
        raise _bad("messages is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    return [_parse_message(m) for m in raw]


def _parse_message(raw: object) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise _bad("each message must be an object", "messages")
    role = raw.get("role")
    if role not in _CHAT_ROLES:
        raise _bad(f"message role must be one of {sorted(_CHAT_ROLES)}, got {role!r}", "messages")
    message = {"role": role, "content": _flatten_content(raw.get("content"))}
    if isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    return message


def _flatten_content(content: object) -> str:
    # A list of text parts is joined with newlines (vLLM's "string" content format).
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("message content must be a string or a list of text parts", "messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _unsupported("messages", "only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise _bad("a text content part needs a string 'text'", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def make_sampling_params(request: GenerateRequest, max_tokens: int) -> SamplingParams:
    if request.sampling.min_tokens > max_tokens:
        raise _bad(
            f"min_tokens ({request.sampling.min_tokens}) must be <= max_tokens ({max_tokens})",
            "min_tokens",
        )
    return _sampling_or_400(request.sampling.replace, max_tokens=max_tokens)


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and type(value) is not int:
        raise _bad(f"{name} must be an integer", name)
    return value


def _max_tokens(body: Mapping[str, Any], name: str) -> int | None:
    value = _opt_int(body, name)
    if value is not None and value <= 0:
        raise _bad(f"{name} must be >= 1, got {value}", name)
    return value


def _opt_number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is not None and type(value) not in (int, float):
        raise _bad(f"{name} must be a number", name)
    return None if value is None else float(value)


def _opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean", name)
    return value


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(f"{name} must be a string", name)
    return value


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


def _unsupported(param: str, message: str | None = None) -> APIError:
    message = message or f"{param} is not supported by this server"
    return APIError(400, message, code="unsupported_parameter", param=param)
