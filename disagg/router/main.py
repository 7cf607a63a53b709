"""`disagg route`: flags -> RouterConfig -> the router app, served until SIGINT or SIGTERM.

Owns the command line and the process lifetime only; the flows are in flows.py. Never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any, get_args

from disagg.config import (
    CLUSTER_TOKEN_ENV,
    FailurePolicy,
    PolicyName,
    RouterConfig,
    RouterMode,
    env_cluster_token,
    field_help,
    resolve_api_key,
)
from disagg.router.app import make_app, start_server
from disagg.router.instances import normalize_url
from disagg.security import tls

__all__ = ["add_arguments", "build_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = {name: default for name, (default, _) in field_help(RouterConfig).items()}
    for pool, text in _POOL_FLAGS:
        parser.add_argument(
            f"--{pool}", nargs="+", action="extend", default=[], metavar="URL", help=text
        )
    for name, choices, text in _CHOICE_FLAGS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, choices=get_args(choices), default=defaults[name], help=text)
    parser.add_argument("--host", default=defaults["host"], help="address to listen on")
    parser.add_argument("--port", type=int, default=defaults["port"], help="0 = any free port")
    parser.add_argument(
        "--advertise-url", default="", metavar="URL",
        help="the URL instances reach the router at, when not --host:--port (a Service, a "
        "proxy): their signed calls must be for it",
    )  # fmt: skip
    parser.add_argument(
        "--api-key",
        default="",
        help="clients must send 'Authorization: Bearer KEY' (default: --api-key-file, else "
        "$DISAGG_API_KEY, else open); other users of the host can read it in the process list",
    )
    parser.add_argument(
        "--api-key-file", type=Path, metavar="PATH",
        help="read the API key from this file, which keeps it out of the process list",
    )  # fmt: skip
    parser.add_argument(
        "--cluster-token",
        default="",
        help=f"the cluster's shared secret (default: ${CLUSTER_TOKEN_ENV}); needed by pull/push",
    )
    _add_value_arguments(parser, defaults, _LIMIT_FLAGS)
    parser.add_argument(
        "--internal-tls-cert", default="", metavar="PEM",
        help="serve HTTPS with this certificate (with --internal-tls-key): keeps prompts "
        "and KV metadata secret on a network others can read",
    )  # fmt: skip
    parser.add_argument("--internal-tls-key", default="", metavar="PEM",
                        help="the certificate's private key")  # fmt: skip
    parser.add_argument(
        "--internal-tls-ca", default="", metavar="PEM",
        help="CA the instances' certificates chain to, for https:// instance URLs",
    )  # fmt: skip
    _add_value_arguments(parser, defaults, _RESILIENCE_FLAGS, " (default: %(default)s)")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"], help="log verbosity"
    )


# The instance URLs of each pool given on the command line: (pool, help).
_POOL_FLAGS = (
    ("prefill", "prefill instance base URL(s); or let instances register (disagg serve --router)"),
    ("decode", "decode instance base URL(s); in aggregated mode they serve whole requests"),
)

# Flags that choose one of RouterConfig's literals: (field, its Literal type, help).
_CHOICE_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("mode", RouterMode, "pull / push: prefill on --prefill, decode on --decode; aggregated: "
     "whole requests on --decode"),
    ("policy", PolicyName, "how an instance is chosen for each request"),
    ("failure_policy", FailurePolicy, "recompute: a request whose prefill instance fails is "
     "prefilled on a decode instance"),
)  # fmt: skip

# Flags that set RouterConfig's field of the same name: (field, type, help).
_Flags = tuple[tuple[str, type, str], ...]

# Polling, timeouts and size bounds.
_LIMIT_FLAGS: _Flags = (
    ("load_poll_interval_s", float, "seconds between polls of each instance's health and load"),
    ("request_timeout_s", float, "a request not finished by then is aborted (HTTP 504)"),
    ("max_request_bytes", int, "larger request bodies get HTTP 413"),
    ("max_prompt_chars", int, "longer text or chat prompts get HTTP 400 before any leg is sent "
     "(default: an instance's bound at a 128k-token context; 0 = leave it to the instances)"),
    ("heartbeat_timeout_s", float, "drop an instance that registered itself (disagg serve "
     "--router) after this long without a heartbeat"),
    ("header_timeout_s", float, "seconds a connection gets to send a request's headers before "
     "it is closed"),
    ("body_timeout_s", float, "seconds a request gets to send its whole body; later ones get "
     "HTTP 408"),
)  # fmt: skip

# Retries, circuit breakers and admission.
_RESILIENCE_FLAGS: _Flags = (
    ("max_retries", int, "resend a leg that never reached its instance (connection refused) "
     "to another one at most this many times per request, never once the client got a byte; "
     "0 = off"),
    ("retry_backoff_s", float, "seconds before the first resend, doubled for each next one"),
    ("retry_max_backoff_s", float, "the longest wait before a resend"),
    ("breaker_failures", int, "an instance that fails this many legs in a row (unreachable, "
     "broken, timed out, 502/503/504) takes no work until its cool-down ends; 0 = off"),
    ("breaker_cooldown_s", float, "seconds an open circuit breaker keeps its instance out; "
     "then one request probes it"),
    ("max_concurrent_requests", int, "client requests served at once; 0 = no limit"),
    ("max_queued_requests", int, "requests waiting for a free slot beyond "
     "--max-concurrent-requests; more get HTTP 429"),
    ("queue_timeout_s", float, "seconds a request waits for a free slot, then HTTP 503"),
)  # fmt: skip


def _add_value_arguments(
    parser: argparse.ArgumentParser, defaults: dict[str, Any], flags: _Flags, suffix: str = ""
) -> None:
    for name, kind, text in flags:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=defaults[name], help=text + suffix)


def _values(args: argparse.Namespace, flags: _Flags) -> dict[str, Any]:
    return {name: getattr(args, name) for name, _, _ in flags}


def build_config(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError naming the bad flag value (RouterConfig validates)."""
    return RouterConfig(
        prefill_urls=tuple(normalize_url(url) for url in args.prefill),
        decode_urls=tuple(normalize_url(url) for url in args.decode),
        mode=args.mode,
        policy=args.policy,
        host=args.host,
        port=args.port,
        advertise_url=args.advertise_url,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        cluster_token=args.cluster_token or env_cluster_token(),
        failure_policy=args.failure_policy,
        tls_cert_file=args.internal_tls_cert,
        tls_key_file=args.internal_tls_key,
        tls_ca_file=args.internal_tls_ca,
        **_values(args, _LIMIT_FLAGS),
        **_values(args, _RESILIENCE_FLAGS),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.api_key:
        print("disagg route: warning: --api-key shows in the process list to every user of "
              "this host; use --api-key-file or $DISAGG_API_KEY", file=sys.stderr)  # fmt: skip
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
        listen_tls = tls.server_context(cfg.tls_cert_file, cfg.tls_key_file)
        runner, port = await start_server(
            make_app(cfg), cfg.host, cfg.port, header_timeout_s=cfg.header_timeout_s,
            ssl_context=listen_tls,
        )  # fmt: skip
    except OSError as exc:  # port taken, bad host
        print(f"disagg route: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
    print(f"disagg route ready on {tls.scheme(listen_tls is not None)}://{cfg.host}:{port}",
          flush=True)  # fmt: skip
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
