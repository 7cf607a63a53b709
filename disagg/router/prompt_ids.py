"""The token ids an instance will compute for a request, as far as the router can tell: what
kv_aware matches against the instances' cached blocks.

A prompt given as token ids is used as it is. Text and chat need the instances' tokenizer
(`disagg route --tokenizer DIR`; `disagg up` passes the model's): the same encoding and chat
template the server applies (server/app.py `_prompt_ids`), so the ids agree. Advisory: when
the router cannot tell (no tokenizer, a shape the server would refuse) the answer is None and
the policy weighs load alone. Tokenizing holds the GIL, so text goes to a thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from disagg.server.tokenizer import Tokenizer

__all__ = ["prompt_token_ids"]


async def prompt_token_ids(
    body: dict[str, Any], path: str, tokenizer: Tokenizer | None
) -> list[int] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if tokenizer is None:
        return None
    return await asyncio.to_thread(_encode, body, path, tokenizer)


def _encode(body: dict[str, Any], path: str, tokenizer: Tokenizer) -> list[int] | None:
    try:
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            add_prompt = body.get("add_generation_prompt", True)
            if not isinstance(messages, list) or not isinstance(add_prompt, bool):
                return None
            text = tokenizer.apply_chat_template(messages, add_prompt)
            return tokenizer.encode(text, add_special_tokens=False)  # the template has BOS
        prompt = body.get("prompt")
        return tokenizer.encode(prompt) if isinstance(prompt, str) else None
    except (ValueError, TypeError, AttributeError):  # a shape the server will refuse itself
        return None
