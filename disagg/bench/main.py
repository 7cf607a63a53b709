"""`disagg bench`: load-test any OpenAI-compatible server (and `disagg bench sweep`).

Owns the command line: flags into a BenchConfig, one `run_benchmark` (runner.py), then a
table and one JSON summary as the last stdout line; `disagg bench sweep` is sweep.py's.
Never imports torch: the benchmark must run anywhere a client can.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import aiohttp

from disagg.bench import report, sweep
from disagg.bench.flags import (
    add_arrival_arguments,
    add_workload_arguments,
    from_flags,
    workload_from_args,
)
from disagg.bench.metrics import parse_goodput, parse_percentiles
from disagg.bench.runner import BenchConfig, run_benchmark

__all__ = ["add_arguments", "config_from_args", "run"]


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    g = add_arrival_arguments(parser)
    g.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagg bench`; `disagg bench sweep ...` is a sub-command with its own flags."""
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
    return from_flags(
        BenchConfig,
        args,
        workload=workload_from_args(args),
        percentiles=parse_percentiles(args.percentiles),
        goodput_slos_ms=parse_goodput(args.goodput),
        stream=not args.no_stream,
        ignore_eos=not args.no_ignore_eos,
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
