"""`disagg route`: flags -> RouterConfig -> the router app, served until SIGINT or SIGTERM.

Owns the command line and the process lifetime only; the flows live in app.py. Never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import get_args

from disagg.config import (
    CLUSTER_TOKEN_ENV,
    FailurePolicy,
    PolicyName,
    RouterConfig,
    RouterMode,
    env_cluster_token,
    field_help,
)
from disagg.router.app import make_app, start_server
from disagg.router.instances import normalize_url

__all__ = ["add_arguments", "build_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = {name: default for name, (default, _) in field_help(RouterConfig).items()}
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="prefill instance base URL(s); or let instances register (disagg serve --router)",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="decode instance base URL(s); in aggregated mode they serve whole requests",
    )
    parser.add_argument(
        "--mode",
        choices=get_args(RouterMode),
        default=defaults["mode"],
        help="pull / push: prefill on --prefill, decode on --decode; aggregated: whole "
        "requests on --decode",
    )
    parser.add_argument(
        "--policy",
        choices=get_args(PolicyName),
        default=defaults["policy"],
        help="how an instance is chosen for each request",
    )
    parser.add_argument("--host", default=defaults["host"], help="address to listen on")
    parser.add_argument("--port", type=int, default=defaults["port"], help="0 = any free port")
    parser.add_argument(
        "--load-poll-interval-s",
        type=float,
        default=defaults["load_poll_interval_s"],
        help="seconds between polls of each instance's health and load",
    )
    parser.add_argument(
        "--request-timeout-s", type=float, default=defaults["request_timeout_s"],
        help="a request not finished by then is aborted (HTTP 504)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key",
        default="",
        help="clients must send 'Authorization: Bearer KEY' (default: open)",
    )
    parser.add_argument(
        "--cluster-token",
        default="",
        help=f"the cluster's shared secret (default: ${CLUSTER_TOKEN_ENV}); needed by pull/push",
    )
    parser.add_argument(
        "--failure-policy",
        choices=get_args(FailurePolicy),
        default=defaults["failure_policy"],
        help="recompute: a request whose prefill instance fails is prefilled on a decode instance",
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=defaults["max_request_bytes"],
        help="larger request bodies get HTTP 413",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-timeout-s", type=float, default=defaults["heartbeat_timeout_s"],
        help="drop an instance that registered itself (disagg serve --router) after this long "
        "without a heartbeat",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"], help="log verbosity"
    )


def build_config(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError naming the bad flag value (RouterConfig validates)."""
    return RouterConfig(
        prefill_urls=tuple(normalize_url(url) for url in args.prefill),
        decode_urls=tuple(normalize_url(url) for url in args.decode),
        mode=args.mode,
        policy=args.policy,
        host=args.host,
        port=args.port,
        load_poll_interval_s=args.load_poll_interval_s,
        request_timeout_s=args.request_timeout_s,
        api_key=args.api_key,
        cluster_token=args.cluster_token or env_cluster_token(),
        failure_policy=args.failure_policy,
        max_request_bytes=args.max_request_bytes,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = build_config(args)
    except ValueError as exc:
        print(f"disagg route: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg))


async def _serve(cfg: RouterConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner, port = await start_server(make_app(cfg), cfg.host, cfg.port)
    except OSError as exc:  # port taken, bad host
        print(f"disagg route: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
    print(f"disagg route ready on http://{cfg.host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
