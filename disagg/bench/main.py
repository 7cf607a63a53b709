"""`disagg bench`: load-test any OpenAI-compatible server (and `disagg bench sweep`).

Owns `BenchConfig`, the `run_benchmark` orchestration (workload -> warm-up -> paced load ->
metrics) and the command line. Prints a table, then one JSON summary as the last stdout line.
Never imports torch: the benchmark must run anywhere a client can.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import aiohttp

from disagg.bench import report
from disagg.bench.arrivals import arrival_offsets_s
from disagg.bench.client import (
    build_payload,
    fetch_model_id,
    is_chat_endpoint,
    make_session,
    run_requests,
)
from disagg.bench.flags import (
    add_arrival_arguments,
    add_workload_arguments,
    workload_from_args,
    workload_keys,
)
from disagg.bench.host import describe_host
from disagg.bench.metrics import compute_metrics, parse_goodput, parse_percentiles
from disagg.bench.workload import (
    BenchPrompt,
    WorkloadConfig,
    load_tokenizer,
    make_workload,
    to_text_prompts,
)

__all__ = ["BenchConfig", "add_arguments", "config_from_args", "run", "run_benchmark"]

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


def _bodies(cfg: BenchConfig, model: str, prompts: list[BenchPrompt]) -> list[dict[str, Any]]:
    return [
        build_payload(
            p,
            model=model,
            endpoint=cfg.endpoint,
            stream=cfg.stream,
            ignore_eos=cfg.ignore_eos,
            temperature=cfg.temperature,
            extra_body=cfg.extra_body,
        )
        for p in prompts
    ]


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


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    g = add_arrival_arguments(parser)
    g.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagg bench`; `disagg bench sweep ...` is a sub-command with its own flags."""
    from disagg.bench import sweep  # imported here: sweep imports this module

    parser.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions"
    )
    parser.add_argument("--model", default=None, help="model id; default: first of /v1/models")
    add_workload_arguments(parser).add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or model dir: exact text lengths, token ids for chat",
    )
    _add_load_arguments(parser)
    g = parser.add_argument_group("request and output")
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end outputs early")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--extra-body", default=None, help="JSON object merged into each request")
    g.add_argument("--percentiles", default="90,99", help="comma-separated, e.g. 90,99,99.9")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs a request must all meet: ttft:MS tpot:MS e2el:MS",
    )
    g.add_argument("--result-file", default=None, help="write the full JSON result here")
    g.add_argument("--plot-dir", default=None, help="write latency_cdf.png here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub = parser.add_subparsers(dest="bench_command", metavar="{sweep}")
    sweep.add_arguments(sub.add_parser("sweep", help="mode x rate x prompt-length sweep"))


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A BenchConfig from parsed `disagg bench` flags (raises ValueError on bad values)."""
    if not args.base_url:
        raise ValueError("--base-url is required")
    workload = workload_from_args(args)
    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        workload=workload,
        tokenizer=args.tokenizer,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        percentiles=parse_percentiles(args.percentiles),
        goodput_slos_ms=parse_goodput(args.goodput),
        stream=not args.no_stream,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        extra_body=_parse_extra_body(args.extra_body),
        request_timeout_s=args.request_timeout,
        show_progress=not args.no_progress,
    )


def _parse_extra_body(text: str | None) -> dict[str, Any]:
    body = json.loads(text) if text else {}
    if not isinstance(body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return body


def run(args: argparse.Namespace) -> int:
    """`disagg bench`: exit 0 when at least one request completed, 1 otherwise, 2 on bad flags."""
    if getattr(args, "bench_command", None) == "sweep":
        from disagg.bench import sweep

        return sweep.run(args)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"disagg bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (ValueError, OSError, aiohttp.ClientError) as exc:  # unreachable server, bad model
        print(f"disagg bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(report.format_table(result, cfg.percentiles))
    if failures := report.failure_summary(result):
        print(failures, file=sys.stderr)
    if args.result_file:
        report.write_json(result, args.result_file)
    if args.plot_dir:
        report.plot_run(result, args.plot_dir)
    print(report.to_json_line(result))
    return 0 if result["completed"] > 0 else 1
