"""`disagg serve`: one engine instance (role both, prefill or decode) behind its HTTP app.

Owns the command's flags (derived from the config dataclasses' fields, defaults and choices) and
the process lifecycle: resolve the model, start the engine, serve until SIGINT/SIGTERM, shut down.
Must not hold serving logic (app.py) or engine logic (disagg.engine).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal

from disagg.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    SchedulerConfig,
    ServerConfig,
    env_cluster_token,
)

__all__ = ["add_arguments", "build_configs", "run"]

# (config class, field, flag). The flag's type, default and choices come from the field.
_FLAGS: tuple[tuple[type, str, str], ...] = (
    (EngineConfig, "model", "--model"),
    (EngineConfig, "served_model_name", "--served-model-name"),
    (ServerConfig, "host", "--host"),
    (ServerConfig, "port", "--port"),
    (ServerConfig, "api_key", "--api-key"),
    (ServerConfig, "max_request_bytes", "--max-request-bytes"),
    (EngineConfig, "device", "--device"),
    (EngineConfig, "dtype", "--dtype"),
    (EngineConfig, "seed", "--seed"),
    (EngineConfig, "num_threads", "--num-threads"),
    (CacheConfig, "block_size", "--block-size"),
    (CacheConfig, "num_blocks", "--num-blocks"),
    (SchedulerConfig, "max_num_seqs", "--max-num-seqs"),
    (SchedulerConfig, "max_num_batched_tokens", "--max-num-batched-tokens"),
    (SchedulerConfig, "max_model_len", "--max-model-len"),
    (SchedulerConfig, "enable_prefix_caching", "--no-prefix-caching"),
    (KVTransferConfig, "role", "--role"),
    (KVTransferConfig, "connector", "--kv-connector"),
    (KVTransferConfig, "transport", "--kv-transport"),
    (KVTransferConfig, "host", "--kv-host"),
    (KVTransferConfig, "fault", "--kv-fault"),
    (KVTransferConfig, "engine_id", "--engine-id"),
    (KVTransferConfig, "lease_s", "--lease-s"),
    (KVTransferConfig, "reservation_timeout_s", "--reservation-timeout-s"),
    (KVTransferConfig, "transfer_timeout_s", "--transfer-timeout-s"),
    (KVTransferConfig, "failure_policy", "--failure-policy"),
    (KVTransferConfig, "pull_setup", "--pull-setup"),
    (KVTransferConfig, "cluster_token", "--cluster-token"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for cls, name, flag in _FLAGS:
        _add_flag(parser, cls, name, flag)


def _dest(cls: type, name: str) -> str:
    # Prefixed: KVTransferConfig.host and ServerConfig.host are different flags.
    return f"{cls.__name__}.{name}"


def _add_flag(parser: argparse.ArgumentParser, cls: type, name: str, flag: str) -> None:
    kind = typing.get_type_hints(cls)[name]
    default = next(f.default for f in fields(cls) if f.name == name)
    assert default is not MISSING, f"{cls.__name__}.{name} needs a default to become a flag"
    dest = _dest(cls, name)
    if kind is bool:
        # The flag names the non-default behaviour (--no-prefix-caching sets the field False).
        action = "store_false" if default else "store_true"
        parser.add_argument(flag, dest=dest, action=action, help=f"sets {name}={not default}")
        return
    extra: dict[str, Any] = {"metavar": flag.removeprefix("--").replace("-", "_").upper()}
    if typing.get_origin(kind) is Literal:
        extra = {"choices": list(typing.get_args(kind))}  # argparse shows them as the metavar
        kind = type(extra["choices"][0])
    help_text = f"{cls.__name__}.{name} (default: {default!r})"
    parser.add_argument(flag, dest=dest, type=kind, default=default, help=help_text, **extra)


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Parsed flags -> validated configs. ValueError names the bad field and value."""
    values: dict[type, dict[str, Any]] = {}
    for cls, name, _ in _FLAGS:
        values.setdefault(cls, {})[name] = getattr(args, _dest(cls, name))
    kv_values = values[KVTransferConfig]
    kv_values["cluster_token"] = kv_values["cluster_token"] or env_cluster_token()
    engine = EngineConfig(
        **values[EngineConfig],
        scheduler=SchedulerConfig(**values[SchedulerConfig]),
        cache=CacheConfig(**values[CacheConfig]),
        kv_transfer=KVTransferConfig(**values[KVTransferConfig]),
    )
    return engine, ServerConfig(**values[ServerConfig])


def run(args: argparse.Namespace) -> int:
    try:
        config, server = build_configs(args)
    except (TypeError, ValueError) as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    from disagg.engine.checkpoint import resolve_model  # lazy: pulls in torch

    try:
        model_dir = resolve_model(config.model)
    except (OSError, ValueError) as exc:
        print(f"disagg serve: cannot resolve model {config.model!r}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(config, server, model_dir))
    return 0


async def _serve(config: EngineConfig, server: ServerConfig, model_dir: Path) -> None:
    from disagg.engine.async_engine import AsyncEngine
    from disagg.server.app import make_app, start_server
    from disagg.server.kv_routes import kv_routes
    from disagg.tokenizer import Tokenizer

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
            max_request_bytes=server.max_request_bytes,
        )
        runner, port = await start_server(app, server.host, server.port)
        engine.set_address(server.host, port)  # peers reach the KV side channel here
        try:
            print(f"disagg serve ready on http://{server.host}:{port}", flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await engine.shutdown()


def _stop_event() -> asyncio.Event:
    """Set by SIGINT/SIGTERM (the loop's close() restores the default handlers)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
