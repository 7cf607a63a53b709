"""Multi-turn conversations (`--dataset multiturn`): N conversations x T turns, run at once,
each one's turns in order.

Every conversation opens with the same system prompt (`prefix_len` tokens); each turn adds a
user message (`input_len` tokens) to the history, and the answer the server actually returned
joins the history before the next turn, as a chat client does. So turn t's prompt holds the
whole conversation so far: what a prefix cache (or a router that knows where the KV is) can
reuse. Chat endpoints get the history as messages; completions get it as one text. A turn that
fails ends its conversation (the turns after it are never sent, so none is counted twice).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from disagg.bench.client import build_payload, is_chat_endpoint, send_request
from disagg.bench.metrics import RequestResult
from disagg.bench.progress import Progress
from disagg.bench.workload import BenchPrompt, TextTokenizer, WorkloadConfig, make_texts

__all__ = ["Conversation", "conversation_prompt", "make_conversations", "run_conversations"]

_USER_SEED_OFFSET = 7_919  # user turns come from their own stream: the system prompt is shared


@dataclass(frozen=True, slots=True)
class Conversation:
    system: str  # the same for every conversation of a workload
    user_turns: tuple[str, ...]
    output_len: int  # tokens each answer is asked for (max_tokens)
    approx_turn_tokens: int  # a user turn's length in tokens (exact with a tokenizer)
    approx_system_tokens: int


def make_conversations(
    cfg: WorkloadConfig, tokenizer: TextTokenizer | None = None
) -> list[Conversation]:
    """`cfg.num_prompts` conversations of `cfg.num_turns` turns, deterministic in the seed."""
    system = make_texts(np.random.default_rng(cfg.seed), [cfg.prefix_len], tokenizer)[0]
    rng = np.random.default_rng(cfg.seed + _USER_SEED_OFFSET)
    lengths = [cfg.input_len] * (cfg.num_prompts * cfg.num_turns)
    users = make_texts(rng, lengths, tokenizer)
    t = cfg.num_turns
    return [
        Conversation(
            system, tuple(users[i * t : (i + 1) * t]), cfg.output_len, cfg.input_len, cfg.prefix_len
        )  # fmt: skip
        for i in range(cfg.num_prompts)
    ]


def conversation_prompt(
    conv: Conversation, answers: list[str], turn: int, *, is_chat: bool
) -> str | list[dict[str, str]]:
    """What turn `turn` (0-based) sends: the system prompt, every earlier user turn followed by
    the answer it got, then this turn's user message. Messages for chat, one text otherwise."""
    assert len(answers) == turn, "one answer per earlier turn"
    messages = [{"role": "system", "content": conv.system}]
    for user, answer in zip(conv.user_turns[:turn], answers, strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": conv.user_turns[turn]})
    if is_chat:
        return messages
    return "\n".join(m["content"] for m in messages)


async def _play(
    session: aiohttp.ClientSession,
    url: str,
    conv: Conversation,
    payload: dict[str, Any],
    progress: Progress,
) -> list[RequestResult]:
    """One conversation's turns, in order; stops at the first that fails."""
    results: list[RequestResult] = []
    answers: list[str] = []
    is_chat = is_chat_endpoint(url)
    for turn in range(len(conv.user_turns)):
        prompt = conversation_prompt(conv, answers, turn, is_chat=is_chat)
        estimate = conv.approx_system_tokens + (turn + 1) * conv.approx_turn_tokens
        estimate += turn * conv.output_len
        text = prompt if isinstance(prompt, str) else ""
        bench_prompt = BenchPrompt(text, estimate, conv.output_len, is_exact_len=False)
        body = build_payload(bench_prompt, endpoint=url, **payload)
        if not isinstance(prompt, str):
            body["messages"] = prompt  # the whole conversation, not one user message
        result = await send_request(session, url, bench_prompt, body)
        result.turn = turn + 1
        results.append(result)
        progress.update()
        if not result.success:
            break
        answers.append(result.output_text)
    return results


async def run_conversations(
    session: aiohttp.ClientSession,
    url: str,
    conversations: list[Conversation],
    offsets_s: list[float],
    payload: dict[str, Any],
    *,
    show_progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Start conversation i at `offsets_s[i]`; `payload`: build_payload's keyword arguments
    (model, stream, ...). Returns every turn's result, conversation by conversation, and the
    wall-clock duration in seconds."""
    assert len(conversations) == len(offsets_s), "one offset per conversation"
    total = sum(len(c.user_turns) for c in conversations)
    progress = Progress(total, is_shown=show_progress)
    start_s = time.perf_counter()
    tasks = []
    for conv, offset in zip(conversations, offsets_s, strict=True):
        delay = start_s + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_play(session, url, conv, payload, progress)))
    played = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start_s
    progress.close()
    return [r for results in played for r in results], duration_s
