"""Fakes for server tests: a tiny trained tokenizer directory, a scripted engine, a server thread.

The engine fake implements `EngineClient` with scripted token ids and small delays and records
every request and abort, so tests can assert on what the HTTP layer asked of the engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from disagg.protocol import (
    FinishReason,
    KVTransferParams,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
    TTFTBreakdown,
)
from disagg.server.app import start_server

__all__ = [
    "CHATML_TEMPLATE",
    "ScriptedEngine",
    "ServerThread",
    "Submitted",
    "make_tokenizer_dir",
]

CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'forbidden' %}{{ raise_exception('role forbidden') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = (
    "Once upon a time, there was a little girl named Lily. She liked to play in the garden. "
    "The quick brown fox jumps over the lazy dog. Hello world, this is a test of the server. "
    "Paris is the capital of France. Le café est très bon à Paris. "
    "Tokyo 東京 is big; emoji 🙂 and 🚀 are fun. Numbers: 0123456789. "
)


def make_tokenizer_dir(path: Path) -> Path:
    """Train a small byte-level BPE (a few KB of text) and write an HF-style tokenizer dir.

    Rare characters (CJK, emoji) stay split into byte tokens, which exercises split UTF-8."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    # BOS is added by the post-processor, so add_special_tokens has something to do.
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@dataclass(slots=True)
class Submitted:
    """One `generate` call as the fake engine saw it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv_transfer_params: KVTransferParams | None


@dataclass
class ScriptedEngine:
    """Yields `output_ids` one token per delta (EOS-like STOP after the script, LENGTH at
    max_tokens). Knobs make it refuse, overload, fail with ERROR, or return kv params."""

    output_ids: list[int]
    model_name: str = "fake-model"
    max_model_len: int = 256
    eos_token_ids: tuple[int, ...] = (2,)
    dtype: str = "float32"
    delay_s: float = 0.002
    error: str | None = None  # finish with ERROR ...
    error_after: int = 1  # ... in the delta carrying this many output tokens
    refuse: type[Exception] | None = None  # raised by generate (ValueError, EngineOverloadedError)
    crash_after: int | None = None  # the output iterator raises RuntimeError after this many
    kv_params_out: KVTransferParams | None = None
    healthy: bool = True
    submitted: list[Submitted] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)  # ids fence() refused from then on
    aborted: list[str] = field(default_factory=list)
    kv_events_asked: list[tuple[str, int]] = field(default_factory=list)
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self.refuse is not None:
            raise self.refuse(f"fake engine refuses {request_id}")
        self.submitted.append(
            Submitted(request_id, list(prompt_token_ids), sampling, kv_transfer_params)
        )
        self._abort_events[request_id] = asyncio.Event()
        return self._outputs(request_id, len(prompt_token_ids), sampling)

    async def _outputs(
        self, request_id: str, num_prompt: int, sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        aborted = self._abort_events[request_id]
        for i, token_id in enumerate(self.output_ids[: sampling.max_tokens]):
            await asyncio.sleep(self.delay_s)
            if i == self.crash_after:
                raise RuntimeError("engine loop exploded")
            if aborted.is_set():
                yield RequestOutput(request_id, [], FinishReason.ABORT, num_prompt, i)
                return
            out = self._delta(request_id, token_id, num_prompt, i + 1, sampling)
            yield out
            if out.is_finished:
                return

    def _delta(
        self, request_id: str, token_id: int, num_prompt: int, num_out: int, sp: SamplingParams
    ) -> RequestOutput:
        finish: FinishReason | None = None
        if self.error is not None and num_out >= self.error_after:
            finish = FinishReason.ERROR
        elif num_out == sp.max_tokens:
            finish = FinishReason.LENGTH
        elif num_out == len(self.output_ids):
            finish = FinishReason.STOP
        out = RequestOutput(request_id, [token_id], finish, num_prompt, num_out)
        if sp.logprobs is not None:
            out.new_logprobs = [_fake_logprobs(token_id, sp.logprobs)]
        if finish is not None:
            out.error = self.error
            out.kv_transfer_params = self.kv_params_out
            out.breakdown = TTFTBreakdown(queue_s=0.001, prefill_s=0.002)
        return out

    async def fence(self, request_id: str) -> bool:
        """Held while submitted and not aborted; otherwise fenced (recorded)."""
        is_held = request_id in {s.request_id for s in self.submitted}
        is_held = is_held and request_id not in self.aborted
        if is_held:
            await self.abort(request_id)
        else:
            self.fenced.append(request_id)
        return is_held

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        event = self._abort_events.get(request_id)
        if event is not None:
            event.set()

    def load(self) -> dict[str, int]:
        return {
            "num_running": 1,
            "num_waiting": 2,
            "num_free_blocks": 90,
            "num_total_blocks": 100,
            "num_queued_prefill_tokens": 7,
        }

    def is_healthy(self) -> bool:
        return self.healthy

    def kv_info(self) -> dict[str, Any]:
        return {"role": "both", "block_size": 16}

    def kv_events(self, epoch: str, seq: int) -> dict[str, Any]:
        self.kv_events_asked.append((epoch, seq))
        return {"epoch": "e1", "seq": 3, "snapshot": ["00ff00ff00ff00ff"]}


def _fake_logprobs(token_id: int, num_top: int) -> TokenLogprobs:
    """The sampled token rated best at -0.125, then ids 10, 11, ... each 1 nat lower."""
    top_ids = [token_id, *(t for t in range(10, 10 + num_top) if t != token_id)][:num_top]
    return TokenLogprobs(-0.125, top_ids, [-0.125 - i for i in range(len(top_ids))])


class ServerThread:
    """Runs an aiohttp app on 127.0.0.1:<free port> in a thread with its own event loop."""

    def __init__(self, app_factory: Callable[[], web.Application]) -> None:
        self._app_factory = app_factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    def __enter__(self) -> ServerThread:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self._runner, self.port = future.result(timeout=10)
        return self

    async def _start(self) -> tuple[web.AppRunner, int]:
        return await start_server(self._app_factory(), "127.0.0.1", 0)

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
