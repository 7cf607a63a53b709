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

from disagg.config import CLUSTER_TOKEN_ENV, RouterConfig, env_cluster_token, resolve_api_key
from disagg.config_flags import add_field_flag
from disagg.router.app import make_app, start_server
from disagg.router.identity import parse_side_channel
from disagg.router.instances import normalize_url
from disagg.security import tls

__all__ = ["add_arguments", "build_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for pool, text in _POOL_FLAGS:
        parser.add_argument(
            f"--{pool}", nargs="+", action="extend", default=[], metavar="URL", help=text
        )
    for name, flag, text in _FLAGS:
        add_field_flag(
            parser, RouterConfig, name, flag, text, dest=name, metavar=_METAVARS.get(name)
        )
    parser.add_argument(
        "--vllm-side-channel", nargs="+", action="extend", default=[],
        metavar="URL=ENGINE_ID@HOST:PORT",
        help="a vLLM instance's NIXL identity (kv_transfer_config engine_id, "
        "VLLM_NIXL_SIDE_CHANNEL_HOST:PORT, ',tp=N' when its TP size is not 1): a push router "
        "names its prefill instance's on every decode leg; without it, read from vLLM's "
        "/server_info (VLLM_SERVER_DEV_MODE=1)",
    )  # fmt: skip
    # Not a config field: the file is only where RouterConfig.api_key comes from.
    parser.add_argument(
        "--api-key-file", type=Path, metavar="PATH",
        help="read the API key from this file, which keeps it out of the process list",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"], help="log verbosity"
    )


# The instance URLs of each pool given on the command line: (pool, help).
_POOL_FLAGS = (
    ("prefill", "prefill instance base URL(s); or let instances register (disagg serve --router)"),
    ("decode", "decode instance base URL(s); in aggregated mode they serve whole requests"),
)

# (RouterConfig field, flag, help). The flag's type, default and choices come from the field
# (add_field_flag); args.<field> holds its value. Help that says "(default: %(default)s)"
# shows the default where the help formatter would hide it (0, 1.0).
_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("mode", "--mode", "pull / push: prefill on --prefill, decode on --decode; aggregated: "
     "whole requests on --decode"),
    ("policy", "--policy", "how an instance is chosen for each request"),
    ("engine", "--engine", "the instances' engine: auto tells each one's from what it answers "
     "(disagg: /kv_info; vLLM with NixlConnector or NixlPushConnector: /version); one router "
     "drives one kind"),
    ("failure_policy", "--failure-policy", "recompute: a request whose prefill instance fails "
     "is prefilled on a decode instance"),
    ("host", "--host", "address to listen on"),
    ("port", "--port", "0 = any free port"),
    ("advertise_url", "--advertise-url", "the URL instances reach the router at, when not "
     "--host:--port (a Service, a proxy): their signed calls must be for it"),
    ("api_key", "--api-key", "clients must send 'Authorization: Bearer KEY' (default: "
     "--api-key-file, else $DISAGG_API_KEY, else open); other users of the host can read it "
     "in the process list"),
    ("cluster_token", "--cluster-token",
     f"the cluster's shared secret (default: ${CLUSTER_TOKEN_ENV}); needed by pull/push"),
    # Polling, timeouts and size bounds.
    ("load_poll_interval_s", "--load-poll-interval-s",
     "seconds between polls of each instance's health and load"),
    ("request_timeout_s", "--request-timeout-s",
     "a request not finished by then is aborted (HTTP 504)"),
    ("max_request_bytes", "--max-request-bytes", "larger request bodies get HTTP 413"),
    ("max_prompt_chars", "--max-prompt-chars", "longer text or chat prompts get HTTP 400 "
     "before any leg is sent (default: an instance's bound at a 128k-token context; 0 = leave "
     "it to the instances)"),
    ("heartbeat_timeout_s", "--heartbeat-timeout-s", "drop an instance that registered itself "
     "(disagg serve --router) after this long without a heartbeat"),
    ("header_timeout_s", "--header-timeout-s", "seconds a connection gets to send a request's "
     "headers before it is closed"),
    ("body_timeout_s", "--body-timeout-s", "seconds a request gets to send its whole body; "
     "later ones get HTTP 408"),
    ("tls_cert_file", "--internal-tls-cert", "serve HTTPS with this certificate (with "
     "--internal-tls-key): keeps prompts and KV metadata secret on a network others can read"),
    ("tls_key_file", "--internal-tls-key", "the certificate's private key"),
    ("tls_ca_file", "--internal-tls-ca",
     "CA the instances' certificates chain to, for https:// instance URLs"),
    # Retries, circuit breakers and admission.
    ("max_retries", "--max-retries", "resend a leg that never reached its instance (connection "
     "refused) to another one at most this many times per request, never once the client got "
     "a byte; 0 = off (default: %(default)s)"),
    ("retry_backoff_s", "--retry-backoff-s",
     "seconds before the first resend, doubled for each next one (default: %(default)s)"),
    ("retry_max_backoff_s", "--retry-max-backoff-s",
     "the longest wait before a resend (default: %(default)s)"),
    ("breaker_failures", "--breaker-failures", "an instance that fails this many legs in a row "
     "(unreachable, broken, timed out, 502/503/504) takes no work until its cool-down ends; "
     "0 = off (default: %(default)s)"),
    ("breaker_cooldown_s", "--breaker-cooldown-s", "seconds an open circuit breaker keeps its "
     "instance out; then one request probes it (default: %(default)s)"),
    ("max_concurrent_requests", "--max-concurrent-requests",
     "client requests served at once; 0 = no limit (default: %(default)s)"),
    ("max_queued_requests", "--max-queued-requests", "requests waiting for a free slot beyond "
     "--max-concurrent-requests; more get HTTP 429 (default: %(default)s)"),
    ("queue_timeout_s", "--queue-timeout-s",
     "seconds a request waits for a free slot, then HTTP 503 (default: %(default)s)"),
    ("kv_index_max_blocks", "--kv-index-max-blocks", "follow every instance's prefix cache "
     "(GET /kv/events, signed: needs the cluster token) into an index of at most this many "
     "block digests, shown per instance in /instances; 0 = off, or 65536 under kv_aware "
     "(default: %(default)s)"),
    ("kv_aware_request_tokens", "--kv-aware-request-tokens", "kv_aware's cost of an instance "
     "is the prompt tokens it must still compute + its queued prefill tokens + this many per "
     "request already there (default: %(default)s)"),
    ("local_prefill_tokens", "--local-prefill-tokens", "P/D under kv_aware: send a request "
     "whole to the decode instance that caches most of its prompt when it lacks at most this "
     "many tokens of it (conditional disaggregation); 0 = always use a prefill instance "
     "(default: %(default)s)"),
    ("tokenizer", "--tokenizer", "the instances' model directory: lets kv_aware match text and "
     "chat prompts against their caches (token-id prompts need none)"),
)  # fmt: skip
_METAVARS = {"advertise_url": "URL", "tls_cert_file": "PEM", "tls_key_file": "PEM",
             "tls_ca_file": "PEM", "tokenizer": "DIR"}  # fmt: skip


def build_config(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError naming the bad flag value (RouterConfig validates)."""
    prefill_urls = tuple(normalize_url(url) for url in args.prefill)
    decode_urls = tuple(normalize_url(url) for url in args.decode)
    values = {name: getattr(args, name) for name, _, _ in _FLAGS}
    values["api_key"] = resolve_api_key(args.api_key, args.api_key_file)
    values["cluster_token"] = args.cluster_token or env_cluster_token()
    for spec in args.vllm_side_channel:
        url, _ = parse_side_channel(spec)
        normalize_url(url)
    values["vllm_side_channels"] = tuple(args.vllm_side_channel)
    return RouterConfig(prefill_urls=prefill_urls, decode_urls=decode_urls, **values)


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
