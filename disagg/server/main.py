"""`disagg serve`: one engine instance (role both, prefill or decode) behind its HTTP app.

Owns the command's flags (derived from the config dataclasses' fields, defaults and choices) and
the process lifecycle: resolve the model, start the engine, serve until SIGINT/SIGTERM, shut down.
Must not hold serving logic (app.py) or engine logic (disagg.engine).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from disagg.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    SchedulerConfig,
    ServerConfig,
    env_cluster_token,
    resolve_api_key,
)
from disagg.config_flags import add_field_flag
from disagg.security import tls

__all__ = ["add_arguments", "build_configs", "run"]

# (config class, field, flag, help). The flag's type, default and choices come from the field
# (add_field_flag).
_FLAGS: tuple[tuple[type, str, str, str], ...] = (
    (EngineConfig, "model", "--model", "model directory (config.json, tokenizer.json, "
     "*.safetensors) or a known name such as smollm2-135m"),
    (EngineConfig, "served_model_name", "--served-model-name",
     "the name clients use in 'model' (default: the model's directory name)"),
    (ServerConfig, "host", "--host", "address to listen on"),
    (ServerConfig, "port", "--port", "port to listen on (0 = any free port)"),
    (ServerConfig, "api_key", "--api-key",
     "clients must send 'Authorization: Bearer KEY' (default: --api-key-file, else "
     "$DISAGG_API_KEY, else open); other users of the host can read it in the process list"),
    (ServerConfig, "max_request_bytes", "--max-request-bytes",
     "larger request bodies get HTTP 413"),
    (ServerConfig, "max_prompt_chars", "--max-prompt-chars",
     "longer text or chat prompts get HTTP 400 before they are tokenized "
     "(0 = max_model_len x 16)"),
    (ServerConfig, "header_timeout_s", "--header-timeout-s",
     "seconds a connection gets to send a request's headers before it is closed"),
    (ServerConfig, "body_timeout_s", "--body-timeout-s",
     "seconds a request gets to send its whole body; later ones get HTTP 408"),
    (ServerConfig, "router_url", "--router",
     "register with this router (needs the cluster token), heartbeat, and drain on SIGTERM"),
    (ServerConfig, "advertise_url", "--advertise-url",
     "the URL the router reaches this instance at (default: http://HOST:PORT)"),
    (ServerConfig, "heartbeat_s", "--heartbeat-s", "seconds between heartbeats to --router"),
    (ServerConfig, "tls_cert_file", "--internal-tls-cert",
     "serve HTTPS with this PEM certificate (with --internal-tls-key): keeps prompts and KV "
     "metadata secret on a network others can read"),
    (ServerConfig, "tls_key_file", "--internal-tls-key", "the certificate's PEM private key"),
    (KVTransferConfig, "tls_ca_file", "--internal-tls-ca",
     "PEM CA the peers' and the router's certificates chain to; with it, peers' KV side "
     "channels and --router are called over HTTPS"),
    (ServerConfig, "drain_timeout_s", "--drain-timeout-s",
     "on SIGTERM with --router: seconds to let in-flight requests and held KV finish"),
    (EngineConfig, "device", "--device", "where the model runs: cpu, cuda or cuda:N"),
    (EngineConfig, "dtype", "--dtype",
     "weights and KV dtype; auto = bfloat16 on CUDA or on CPUs with AVX512-BF16/AMX, "
     "else float32"),
    (EngineConfig, "seed", "--seed", "sampling seed"),
    (EngineConfig, "num_threads", "--num-threads", "torch CPU threads (0 = torch's default)"),
    (EngineConfig, "attention_backend", "--attention-backend",
     "our CPU kernels: auto = paged attention (prefill and decode) and the fused add+norm and "
     "SiLU x up where they run (built at first use with the C++ compiler), else torch; native "
     "= those kernels or refuse to start; torch = torch's ops only (SDPA over gathered blocks)"),
    (CacheConfig, "block_size", "--block-size", "tokens per KV block (a power of two)"),
    (CacheConfig, "num_blocks", "--num-blocks", "KV blocks in the pool: its size caps the "
     "tokens held at once (num_blocks x block_size)"),
    (SchedulerConfig, "max_num_seqs", "--max-num-seqs", "most requests running at once"),
    (SchedulerConfig, "max_num_batched_tokens", "--max-num-batched-tokens",
     "tokens per engine step (prefill chunks + decodes); longer prompts are chunked"),
    (SchedulerConfig, "max_model_len", "--max-model-len",
     "longest prompt + output per request; longer requests get HTTP 400"),
    (SchedulerConfig, "enable_prefix_caching", "--no-prefix-caching",
     "do not reuse the KV of a prompt prefix seen before"),
    (KVTransferConfig, "role", "--role",
     "both = serve whole requests; prefill / decode = one side of a disaggregated pair"),
    (KVTransferConfig, "connector", "--kv-connector",
     "how KV moves from prefill to decode: pull (decode reads) or push (prefill writes)"),
    (KVTransferConfig, "transport", "--kv-transport",
     "KV transfer library: auto = nixl when installed (pip install 'disagg[nixl]'), else tcp"),
    (KVTransferConfig, "host", "--kv-host", "address peers reach this instance's KV on"),
    (KVTransferConfig, "engine_id", "--engine-id",
     "this instance's name among its peers (default: derived at start)"),
    (KVTransferConfig, "lease_s", "--lease-s",
     "prefill side: seconds a finished prefill's KV waits for its pull before it is freed"),
    (KVTransferConfig, "reservation_timeout_s", "--reservation-timeout-s",
     "decode side (push): seconds reserved blocks wait for their KV before they are freed"),
    (KVTransferConfig, "transfer_timeout_s", "--transfer-timeout-s",
     "a posted KV transfer not done by then fails"),
    (KVTransferConfig, "failure_policy", "--failure-policy",
     "when a KV transfer fails: fail the request, or recompute the prefill on decode"),
    (KVTransferConfig, "pull_setup", "--pull-setup",
     "pull, decode side: build and post the READ on a background thread or inline on "
     "the engine loop (as vLLM does)"),
    (KVTransferConfig, "cluster_token", "--cluster-token",
     "the cluster's shared secret (default: $DISAGG_CLUSTER_TOKEN); needed by prefill/decode"),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for cls, name, flag, help_text in _FLAGS:
        add_field_flag(parser, cls, name, flag, help_text, dest=_dest(cls, name))
    # Not a config field: the file is only where ServerConfig.api_key comes from.
    parser.add_argument("--api-key-file", type=Path, metavar="PATH",
                        help="read the API key from this file, which keeps it out of the "
                        "process list")  # fmt: skip
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"],
                        help="verbosity of disagg's own log lines (other libraries log "
                        "warnings only); INFO names the dtype the engine computes in")  # fmt: skip


def _dest(cls: type, name: str) -> str:
    # Prefixed: KVTransferConfig.host and ServerConfig.host are different flags.
    return f"{cls.__name__}.{name}"


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Parsed flags -> validated configs. ValueError names the bad field and value."""
    values: dict[type, dict[str, Any]] = {}
    for cls, name, _, _ in _FLAGS:
        values.setdefault(cls, {})[name] = getattr(args, _dest(cls, name))
    kv_values = values[KVTransferConfig]
    kv_values["cluster_token"] = kv_values["cluster_token"] or env_cluster_token()
    server_values = values[ServerConfig]
    server_values["api_key"] = resolve_api_key(server_values["api_key"], args.api_key_file)
    engine = EngineConfig(
        **values[EngineConfig],
        scheduler=SchedulerConfig(**values[SchedulerConfig]),
        cache=CacheConfig(**values[CacheConfig]),
        kv_transfer=KVTransferConfig(**values[KVTransferConfig]),
    )
    return engine, ServerConfig(**server_values)


def run(args: argparse.Namespace) -> int:
    _configure_logging(args.log_level)
    if getattr(args, _dest(ServerConfig, "api_key")):
        print("disagg serve: warning: --api-key shows in the process list to every user of "
              "this host; use --api-key-file or $DISAGG_API_KEY", file=sys.stderr)  # fmt: skip
    try:
        config, server = build_configs(args)
    except (TypeError, ValueError) as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    if server.router_url and not config.kv_transfer.cluster_token:
        why = "registrations are signed with it"
        print(f"disagg serve: --router needs the cluster token (--cluster-token or "
              f"$DISAGG_CLUSTER_TOKEN): {why}", file=sys.stderr)  # fmt: skip
        return 2
    if config.kv_transfer.role != "both":
        from disagg.kv.transport import resolve_kind

        resolve_kind(config.kv_transfer.transport)  # a missing library fails before the model loads
    from disagg.engine.checkpoint import resolve_model  # lazy: pulls in torch

    try:
        model_dir = resolve_model(config.model)
    except (OSError, ValueError) as exc:
        print(f"disagg serve: cannot resolve model {config.model!r}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(config, server, model_dir))
    return 0


def _configure_logging(level: str) -> None:
    """disagg's loggers at `level`, everyone else's at WARNING: without a handler Python prints
    warnings only, and the engine's startup lines (the dtype it computes in) were lost. To
    stdout, beside the ready line: stderr carries a failed start's one-line error alone."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    logging.getLogger("disagg").setLevel(level)


async def _serve(config: EngineConfig, server: ServerConfig, model_dir: Path) -> None:
    from disagg.engine.async_engine import AsyncEngine
    from disagg.server.app import make_app, start_server
    from disagg.server.kv_routes import kv_routes
    from disagg.server.tokenizer import Tokenizer

    stop = _stop_event()  # first: a signal during the (long) engine start still shuts down cleanly
    tokenizer = Tokenizer.from_dir(model_dir)
    from disagg.kv.factory import make_connector  # the transport loads only when used

    engine = AsyncEngine(config, model_dir, exit_on_death=True, make_connector=make_connector)
    await engine.start()
    try:
        extra_routes = kv_routes(engine.side_channel())
        app = make_app(
            engine,
            tokenizer,
            extra_routes=extra_routes,
            api_key=server.api_key,
            cluster_token=config.kv_transfer.cluster_token,
            identity=_identity(config, server),
            max_request_bytes=server.max_request_bytes,
            body_timeout_s=server.body_timeout_s,
            max_prompt_chars=server.max_prompt_chars,
        )
        listen_tls = tls.server_context(server.tls_cert_file, server.tls_key_file)
        runner, port = await start_server(
            app, server.host, server.port, header_timeout_s=server.header_timeout_s,
            ssl_context=listen_tls,
        )  # fmt: skip
        engine.set_address(server.host, port)  # peers reach the KV side channel here
        registration = _registration(config, server, port)
        try:
            if registration is not None:
                await registration.start()
            own_url = f"{tls.scheme(listen_tls is not None)}://{server.host}:{port}"
            print(f"disagg serve ready on {own_url}", flush=True)
            await stop.wait()
            if registration is not None:  # still serving: streams finish, peers read our KV
                await registration.drain(engine.is_idle, server.drain_timeout_s)
                load = engine.load()
                print(f"disagg serve drained: {load.get('num_free_blocks')} of "
                      f"{load.get('num_total_blocks')} KV blocks free", flush=True)  # fmt: skip
        finally:
            if registration is not None:
                await registration.leave()
            await runner.cleanup()
    finally:
        await engine.shutdown()


def _identity(config: EngineConfig, server: ServerConfig) -> Any:
    """The names a cluster call may be signed for to reach us, besides the address it
    arrives at: the advertised URL (a port mapping or a Service hides it otherwise), the
    listen host and the KV host (peers' side-channel calls name it)."""
    from disagg.security.call_guard import Identity

    return Identity.of((server.advertise_url,), (server.host, config.kv_transfer.host))


def _registration(config: EngineConfig, server: ServerConfig, port: int) -> Any:
    """The router membership `--router` asks for, or None."""
    if not server.router_url:
        return None
    from disagg.server.registration import Registration

    own_scheme = tls.scheme(bool(server.tls_cert_file))
    own_url = server.advertise_url or f"{own_scheme}://{server.host}:{port}"
    kv = config.kv_transfer
    return Registration(server.router_url, own_url, kv.role, kv.cluster_token, server.heartbeat_s,
                        ssl_context=tls.client_context(kv.tls_ca_file))  # fmt: skip


def _stop_event() -> asyncio.Event:
    """Set by SIGINT/SIGTERM (the loop's close() restores the default handlers)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
