"""One benchmark run against any OpenAI-compatible server: `BenchConfig` and `run_benchmark`
(workload -> warm-up -> paced load -> metrics), the result's header keys included.

Shared by `disagg bench` (main.py) and `disagg bench sweep` (sweep.py); no command line here.
Never imports torch: the benchmark must run anywhere a client can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from disagg.bench.arrivals import arrival_offsets_s
from disagg.bench.client import (
    build_payload,
    fetch_model_id,
    is_chat_endpoint,
    make_session,
    run_requests,
)
from disagg.bench.flags import workload_keys
from disagg.bench.host import describe_host
from disagg.bench.metrics import compute_metrics
from disagg.bench.multiturn import make_conversations, run_conversations
from disagg.bench.workload import (
    BenchPrompt,
    WorkloadConfig,
    load_tokenizer,
    make_workload,
    to_text_prompts,
)

__all__ = ["BenchConfig", "run_benchmark"]

_WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from measured ones (no prefix-cache help)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (no trailing /v1)
    endpoint: str = "/v1/completions"  # or /v1/chat/completions
    model: str | None = None  # None = the first id the server lists at /v1/models
    workload: WorkloadConfig = WorkloadConfig()
    tokenizer: str | None = None  # tokenizer.json or model dir: exact text lengths, chat decoding
    request_rate: float = math.inf  # req/s; inf = all at once
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    max_concurrency: int | None = None  # cap on requests in flight
    warmup: int = 0  # requests sent (and awaited) before measuring
    percentiles: tuple[float, ...] = (90.0, 99.0)
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)  # {"ttft": 500, ...}
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    request_timeout_s: float = 600.0
    show_progress: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.endpoint.startswith("/"):
            raise ValueError(f"endpoint must start with /, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be > 0, got {self.max_concurrency}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def _prompts(cfg: BenchConfig, workload: WorkloadConfig) -> list[BenchPrompt]:
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    prompts = make_workload(workload, tokenizer)
    if is_chat_endpoint(cfg.endpoint) and not isinstance(prompts[0].prompt, str):
        if tokenizer is None:
            raise ValueError(f"{cfg.endpoint} takes text: use --dataset text or pass --tokenizer")
        prompts = to_text_prompts(prompts, tokenizer)
    return prompts


def _payload(cfg: BenchConfig, model: str) -> dict[str, Any]:
    """build_payload's keyword arguments but the endpoint: the same for every request."""
    return {
        "model": model,
        "stream": cfg.stream,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "extra_body": cfg.extra_body,
    }


def _bodies(cfg: BenchConfig, model: str, prompts: list[BenchPrompt]) -> list[dict[str, Any]]:
    payload = _payload(cfg, model)
    return [build_payload(p, endpoint=cfg.endpoint, **payload) for p in prompts]


def _run_header(cfg: BenchConfig, model: str) -> dict[str, Any]:
    w = cfg.workload
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if is_chat_endpoint(cfg.endpoint) else "openai",
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": model,
        **workload_keys(w),
        # JSON has no infinity; vLLM writes the string "inf" too
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "warmup": cfg.warmup,
        "goodput_slos_ms": dict(cfg.goodput_slos_ms),
        # The machine the bench ran on (the servers' too when local, as `disagg up` makes them).
        "host": describe_host(),
    }


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run one benchmark and return the full result (summary keys + per-request lists)."""
    if cfg.workload.dataset == "multiturn":
        return await _run_conversations(cfg)
    prompts = _prompts(cfg, cfg.workload)
    offsets_s = arrival_offsets_s(len(prompts), cfg.request_rate, cfg.burstiness, cfg.workload.seed)
    async with make_session(cfg.max_concurrency, cfg.request_timeout_s) as session:
        model = cfg.model or await fetch_model_id(session, cfg.base_url)
        if cfg.warmup:
            warm_workload = replace(
                cfg.workload,
                num_prompts=cfg.warmup,
                seed=cfg.workload.seed + _WARMUP_SEED_OFFSET,
            )
            warm = _prompts(cfg, warm_workload)
            await run_requests(
                session,
                cfg.url,
                warm,
                _bodies(cfg, model, warm),
                [0.0] * len(warm),
                max_concurrency=cfg.max_concurrency,
            )
        results, duration_s = await run_requests(
            session,
            cfg.url,
            prompts,
            _bodies(cfg, model, prompts),
            offsets_s,
            max_concurrency=cfg.max_concurrency,
            show_progress=cfg.show_progress,
        )
    metrics = compute_metrics(results, duration_s, cfg.percentiles, cfg.goodput_slos_ms or None)
    return {**_run_header(cfg, model), **metrics}


async def _run_conversations(cfg: BenchConfig) -> dict[str, Any]:
    """The multiturn workload: conversations start at the arrival offsets, turns in order."""
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    conversations = make_conversations(cfg.workload, tokenizer)
    w = cfg.workload
    offsets_s = arrival_offsets_s(len(conversations), cfg.request_rate, cfg.burstiness, w.seed)
    async with make_session(cfg.max_concurrency, cfg.request_timeout_s) as session:
        model = cfg.model or await fetch_model_id(session, cfg.base_url)
        payload = _payload(cfg, model)
        if cfg.warmup:  # one-turn conversations under another system prompt: no cache help
            warm_workload = replace(
                w, num_prompts=cfg.warmup, num_turns=1, seed=w.seed + _WARMUP_SEED_OFFSET
            )
            warm = make_conversations(warm_workload, tokenizer)
            await run_conversations(session, cfg.url, warm, [0.0] * len(warm), payload)
        results, duration_s = await run_conversations(
            session, cfg.url, conversations, offsets_s, payload, show_progress=cfg.show_progress
        )
    metrics = compute_metrics(results, duration_s, cfg.percentiles, cfg.goodput_slos_ms or None)
    return {**_run_header(cfg, model), **metrics}
