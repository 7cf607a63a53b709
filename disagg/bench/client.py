"""Async OpenAI-compatible load client: builds requests, streams responses, paces arrivals.

Owns the HTTP side of the benchmark (aiohttp): one `RequestResult` per request with raw
timestamps, request pacing at given offsets under an optional concurrency cap (progress.py
shows how far it got). Computes no statistics (metrics.py does) and never imports torch.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from disagg.bench.metrics import RequestResult
from disagg.bench.progress import Progress
from disagg.bench.workload import BenchPrompt

__all__ = [
    "build_payload",
    "fetch_model_id",
    "is_chat_endpoint",
    "make_session",
    "run_requests",
    "send_request",
]

_BREAKDOWN_KEY = "disagg"  # top-level key our server adds: {"disagg": {"breakdown": {...}}}


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(
    prompt: BenchPrompt,
    *,
    model: str,
    endpoint: str,
    stream: bool = True,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body for one request; `max_tokens` + `ignore_eos` make the output length exact."""
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.output_len, "stream": stream}
    if is_chat_endpoint(endpoint):
        if not isinstance(prompt.prompt, str):
            raise ValueError("chat endpoints take text prompts; decode token ids first")
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM extra field; makes every request produce max_tokens
    body.update(extra_body or {})
    return body


def make_session(max_connections: int | None, timeout_s: float) -> aiohttp.ClientSession:
    """A session whose connection pool never caps the offered load (aiohttp defaults to 100)."""
    connector = aiohttp.TCPConnector(limit=max_connections or 0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


async def fetch_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists at /v1/models."""
    async with session.get(f"{base_url.rstrip('/')}/v1/models") as resp:
        if resp.status != 200:
            raise ValueError(f"GET /v1/models returned HTTP {resp.status}; pass --model")
        models = (await resp.json()).get("data") or []
    if not models:
        raise ValueError("the server lists no models; pass --model")
    return str(models[0]["id"])


def _has_token(choice: dict[str, Any], is_chat: bool) -> bool:
    """Whether a streamed choice carries generated output (one chunk = one timestamp).

    Skips chat's role-only opening delta and a bare closing chunk that only sets finish_reason.
    """
    if is_chat:
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content"))
    text = choice.get("text")
    return text is not None and (text != "" or choice.get("finish_reason") is None)


def _read_extras(data: dict[str, Any], result: RequestResult, usage_out: dict[str, int]) -> None:
    """Usage counts and our server's TTFT breakdown, wherever in the response they appear."""
    usage = data.get("usage")
    if isinstance(usage, dict):
        for key in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(key), int):
                usage_out[key] = usage[key]
    extra = data.get(_BREAKDOWN_KEY)
    breakdown = extra.get("breakdown") if isinstance(extra, dict) else None
    if isinstance(breakdown, dict):
        for key, value in breakdown.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                result.breakdown[key] = float(value)


def _handle_event(
    payload: str, result: RequestResult, usage: dict[str, int], is_chat: bool, now_s: float
) -> bool:
    """Apply one SSE `data:` payload; returns False once the stream is over ([DONE])."""
    if payload == "[DONE]":
        return False
    data = json.loads(payload)
    if not isinstance(data, dict):
        raise ValueError(f"stream event is not a JSON object: {payload[:100]!r}")
    if "error" in data:
        raise ValueError(f"server error in stream: {json.dumps(data['error'])[:300]}")
    choices = data.get("choices") or []
    if choices and _has_token(choices[0], is_chat):
        result.token_times_s.append(now_s)
        result.output_text += _text_of(choices[0], is_chat)
    _read_extras(data, result, usage)
    return True


def _text_of(choice: dict[str, Any], is_chat: bool) -> str:
    """The generated text a choice carries (a streamed delta, or a whole answer's message)."""
    part = (choice.get("delta") or choice.get("message") or {}) if is_chat else choice
    text = part.get("content") if is_chat else part.get("text")
    return text if isinstance(text, str) else ""


def _handle_block(
    block: bytes, result: RequestResult, usage: dict[str, int], is_chat: bool, now_s: float
) -> bool:
    """Apply the `data:` lines of one SSE event block; False once [DONE] was seen."""
    for line in block.decode("utf-8").split("\n"):
        if line.startswith("data:"):
            if not _handle_event(line[5:].strip(), result, usage, is_chat, now_s):
                return False
    return True


async def _read_stream(
    resp: aiohttp.ClientResponse, result: RequestResult, usage: dict[str, int], is_chat: bool
) -> None:
    buffer = b""
    async for chunk in resp.content.iter_any():
        now_s = time.perf_counter()  # every event in this read arrived at the same moment
        buffer = (buffer + chunk).replace(b"\r\n", b"\n")  # a CR LF may straddle two reads
        *blocks, buffer = buffer.split(b"\n\n")
        for block in blocks:
            if not _handle_block(block, result, usage, is_chat, now_s):
                return
    # a final event the server closed without its blank line
    _handle_block(buffer, result, usage, is_chat, time.perf_counter())


async def _read_body(
    resp: aiohttp.ClientResponse, result: RequestResult, usage: dict[str, int]
) -> None:
    data = await resp.json(content_type=None)
    if not isinstance(data, dict):
        raise ValueError("response body is not a JSON object")
    result.end_s = time.perf_counter()
    result.token_times_s.append(result.end_s)  # non-streaming: TTFT == E2EL
    choices = data.get("choices") or []
    if choices and isinstance(choices[0], dict):
        result.output_text = _text_of(choices[0], "message" in choices[0])
    _read_extras(data, result, usage)


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    prompt: BenchPrompt,
    body: dict[str, Any],
) -> RequestResult:
    """POST one request and record its timestamps; failures land in `error`, never raise."""
    result = RequestResult(input_len=prompt.input_len, start_s=time.perf_counter())
    usage: dict[str, int] = {}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                raise ValueError(f"HTTP {resp.status}: {text}")
            if body.get("stream"):
                await _read_stream(resp, result, usage, is_chat_endpoint(url))
            else:
                await _read_body(resp, result, usage)
        if not result.token_times_s:
            raise ValueError("response carried no generated tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_s = result.end_s or time.perf_counter()
    result.output_len = usage.get("completion_tokens", len(result.token_times_s))
    result.input_len = usage.get("prompt_tokens", prompt.input_len)
    return result


async def run_requests(
    session: aiohttp.ClientSession,
    url: str,
    prompts: list[BenchPrompt],
    bodies: list[dict[str, Any]],
    offsets_s: list[float],
    *,
    max_concurrency: int | None = None,
    show_progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send request i at `offsets_s[i]` (waiting for a free slot under `max_concurrency`).

    Returns the results in workload order and the wall-clock duration, seconds.
    """
    assert len(prompts) == len(bodies) == len(offsets_s), "one body and offset per prompt"
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = Progress(len(prompts), is_shown=show_progress)

    async def one(i: int) -> RequestResult:
        if limit is None:
            result = await send_request(session, url, prompts[i], bodies[i])
        else:
            async with limit:
                result = await send_request(session, url, prompts[i], bodies[i])
        progress.update()
        return result

    start_s = time.perf_counter()
    tasks = []
    for i, offset in enumerate(offsets_s):
        delay = start_s + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    results = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start_s
    progress.close()
    return list(results), duration_s
