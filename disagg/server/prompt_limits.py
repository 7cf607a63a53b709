"""How much prompt a request may bring and how many tokens it may ask for: bounds checked before
a body is parsed or a prompt is tokenized (so one request's work stays small), and max_tokens
against the context left once it is. Refusals are 400 `context_length_exceeded` in the OpenAI
shape. Pure: no I/O, no tokenizer (the router checks with it too).
"""

from __future__ import annotations

from disagg.server.openai_api import APIError, GenerateRequest

__all__ = [
    "PROMPT_CHARS_PER_TOKEN",
    "body_byte_limit",
    "check_body_size",
    "check_prompt_size",
    "prompt_char_limit",
    "prompt_chars",
    "resolve_max_tokens",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Chat defaults to "the rest of the context"; capped so a model that never emits EOS cannot hold a
# slot for the whole context on a small machine.
MAX_DEFAULT_CHAT_TOKENS = 1024

# A prompt is refused by its length in characters before it is tokenized (tokenizing 15 MB took
# 17 s holding the GIL, and ~5 GB). A token is ~4 characters of English and rarely over 16
# (whitespace runs, long symbol runs); over a whole prompt 16 is far past any real text.
PROMPT_CHARS_PER_TOKEN = 16


def prompt_char_limit(max_model_len: int) -> int:
    """The default bound on a prompt's characters for a context of `max_model_len` tokens."""
    return max_model_len * PROMPT_CHARS_PER_TOKEN


# JSON spends at most 12 bytes on one character (an astral character as two \\u escapes),
# and a message's 16-character charge covers its braces and role: a body that passes
# check_prompt_size is under this many bytes, plus its other fields' share.
_BODY_BYTES_PER_PROMPT_CHAR = 12
_BODY_BYTES_BESIDE_PROMPT = 1024 * 1024


def body_byte_limit(max_prompt_chars: int) -> int:
    """The largest body whose prompt can pass a `max_prompt_chars` bound: anything larger is
    refused unparsed (parsing 15 MB of JSON holds the GIL for tens of ms, stalling streams)."""
    return max_prompt_chars * _BODY_BYTES_PER_PROMPT_CHAR + _BODY_BYTES_BESIDE_PROMPT


def check_body_size(num_bytes: int, max_prompt_chars: int | None, path: str) -> None:
    """APIError 400 when a body of `num_bytes` cannot hold a prompt within the bound: the
    answer the character check would give, named for the endpoint's prompt field."""
    if max_prompt_chars is not None and num_bytes > (limit := body_byte_limit(max_prompt_chars)):
        message = (
            f"request body is {num_bytes} bytes; a prompt of at most {max_prompt_chars} "
            f"characters fits in {limit}"
        )
        param = "messages" if path.endswith("/chat/completions") else "prompt"
        raise _context_exceeded(message, param)


def check_prompt_size(
    request: GenerateRequest, max_prompt_chars: int | None, max_model_len: int | None = None
) -> None:
    """Refuse a prompt that cannot be worth tokenizing, before it is: text or chat messages
    over `max_prompt_chars` characters (None: no bound), token ids that leave no room in
    `max_model_len` (None: unknown, as on the router). APIError 400 naming the field."""
    if request.prompt_token_ids is not None:
        num_tokens = len(request.prompt_token_ids)
        if max_model_len is not None and num_tokens >= max_model_len:
            message = f"prompt has {num_tokens} tokens; the context is {max_model_len} tokens"
            raise _context_exceeded(message, "prompt")
        return
    num_chars = prompt_chars(request)
    if max_prompt_chars is not None and num_chars > max_prompt_chars:
        param = "prompt" if request.messages is None else "messages"
        message = (
            f"{param} has {num_chars} characters; this server tokenizes at most "
            f"{max_prompt_chars} (about {PROMPT_CHARS_PER_TOKEN} per token of context)"
        )
        raise _context_exceeded(message, param)


def prompt_chars(request: GenerateRequest) -> int:
    """A text or chat prompt's size in characters (0 for token ids): what tokenizing costs."""
    if request.messages is not None:
        # A message costs at least a token (its role marker): 500k empty ones render to 14 MB.
        return sum(
            len(m["content"]) + len(m.get("name", "")) + PROMPT_CHARS_PER_TOKEN
            for m in request.messages
        )
    return len(request.prompt or "")


def _context_exceeded(message: str, param: str) -> APIError:
    return APIError(400, message, code="context_length_exceeded", param=param)


def resolve_max_tokens(request: GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """The request's max_tokens, or the endpoint default clamped to the context left.
    APIError 400 when the prompt plus an explicit max_tokens does not fit."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise APIError(
            400,
            f"prompt has {num_prompt_tokens} tokens; the context is {max_model_len} tokens",
            code="context_length_exceeded",
            param="prompt",
        )
    if request.max_tokens is None:
        cap = MAX_DEFAULT_CHAT_TOKENS if request.is_chat else DEFAULT_COMPLETION_MAX_TOKENS
        return min(cap, room)
    if request.max_tokens > room:
        raise APIError(
            400,
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) exceeds "
            f"the context of {max_model_len} tokens",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return request.max_tokens
