"""`disagg up` configuration: the frozen ClusterConfig, its TOML file, and the commands it implies.

Owns validation (naming field and value), the `disagg up` flags (up.py offers them to the CLI),
merging a TOML file with those flags (flags win), and the argv of every child process.
Starts nothing and never imports torch.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from disagg.config import (
    EngineConfig,
    KVTransferConfig,
    PolicyName,
    PullSetup,
    RouterConfig,
    RouterMode,
    field_help,
)

__all__ = [
    "ClusterConfig",
    "UpTransport",
    "add_arguments",
    "config_from_args",
    "load_toml",
    "merge_config",
]

# auto: nixl when installed, else tcp. "local" is in-process only: useless across processes.
UpTransport = Literal["auto", "nixl", "tcp"]
Backend = Literal["local", "ray"]

# Flags the launcher sets on every instance; a pass-through copy would break the cluster's wiring.
_OWNED_SERVE_FLAGS = ("--model", "--host", "--port", "--role", "--kv-connector", "--kv-transport")
_ARGS_FIELDS = ("serve_args", "prefill_args", "decode_args", "router_args")
_INT_FIELDS = ("num_prefill", "num_decode", "port", "threads_per_instance", "local_prefill_tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """One local cluster: a router in front of prefill and decode (or aggregated) instances."""

    mode: RouterMode = "aggregated"
    num_prefill: int | None = None  # prefill instances; None = 0 when aggregated, else 1
    num_decode: int = 1  # decode instances (role both when aggregated)
    model: str = field_help(EngineConfig)["model"][0]  # short name or model directory
    host: str = "127.0.0.1"  # every process binds here; the router's URL is the cluster's
    port: int = field_help(RouterConfig)["port"][0]  # the router's; 0 = a free one
    kv_transport: UpTransport = "auto"
    policy: PolicyName = "round_robin"
    local_prefill_tokens: int = 0  # the router's --local-prefill-tokens (P/D under kv_aware)
    # Pull: decode instances post READs on their own thread (background) or on the loop.
    pull_setup: PullSetup = field_help(KVTransferConfig)["pull_setup"][0]
    threads_per_instance: int = 1  # torch intra-op threads per instance
    serve_args: tuple[str, ...] = ()  # extra `disagg serve` flags for every instance
    prefill_args: tuple[str, ...] = ()  # ... for prefill instances only (after serve_args)
    decode_args: tuple[str, ...] = ()  # ... for decode (or aggregated) instances only
    router_args: tuple[str, ...] = ()  # extra `disagg route` flags
    log_dir: Path | None = None  # one log file per process; None = a fresh temp dir
    # The clients' API key, for the router and every instance; None = $DISAGG_API_KEY, else
    # open. Children get it in their environment, never on their command line.
    api_key_file: Path | None = None
    # local: child processes of `disagg up`; ray: Ray actors (cluster/ray_backend.py)
    backend: Backend = "local"
    ray_address: str = ""  # the Ray cluster to join; "" = start a local one (ray backend)
    startup_timeout_s: float = 300.0  # covers model loading on every instance
    stop_timeout_s: float = 10.0  # SIGTERM grace per stage before SIGKILL

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, RouterMode)
        _check_choice("kv_transport", self.kv_transport, UpTransport)
        _check_choice("pull_setup", self.pull_setup, PullSetup)
        _check_choice("backend", self.backend, Backend)
        _check_choice("policy", self.policy, PolicyName)
        self._check_types()
        if self.num_prefill is not None and self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        if self.mode == "aggregated" and self.num_prefill:
            raise ValueError(f"mode aggregated has no prefill instances, got {self.num_prefill}")
        if self.mode != "aggregated" and self.num_prefill == 0:
            raise ValueError(f"mode {self.mode} needs num_prefill >= 1, got 0")
        for name in ("num_decode", "threads_per_instance", "startup_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in _ARGS_FIELDS:
            _check_not_owned(name, getattr(self, name))

    def _check_types(self) -> None:
        # TOML values arrive unchecked; a wrong type must fail here, not inside a child process.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("startup_timeout_s", "stop_timeout_s"):
            if not isinstance(getattr(self, name), int | float):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("model", "host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in _ARGS_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(a, str) for a in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
        for name in ("log_dir", "api_key_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                raise ValueError(f"{name} must be a path, got {value!r}")

    @property
    def num_prefill_instances(self) -> int:
        if self.num_prefill is None:
            return 0 if self.mode == "aggregated" else 1
        return self.num_prefill

    @property
    def roles(self) -> tuple[tuple[str, int], ...]:
        """(role passed to `disagg serve`, instance count), in start order."""
        if self.mode == "aggregated":
            return (("both", self.num_decode),)
        return (("prefill", self.num_prefill_instances), ("decode", self.num_decode))

    def serve_command(self, role: str, model_dir: Path, port: int) -> list[str]:
        """argv of one instance; pass-through flags come last so that they win."""
        cmd = [sys.executable, "-m", "disagg.cli", "serve", "--model", str(model_dir)]
        cmd += ["--served-model-name", self.model]  # clients name the model as the user did
        cmd += ["--host", self.host, "--port", str(port)]
        cmd += ["--num-threads", str(self.threads_per_instance), "--role", role]
        if role != "both":
            cmd += ["--kv-connector", self.mode, "--kv-transport", self.kv_transport]
        if role == "decode" and self.mode == "pull":
            cmd += ["--pull-setup", self.pull_setup]
        role_args = self.prefill_args if role == "prefill" else self.decode_args
        return cmd + list(self.serve_args) + list(role_args)

    def route_command(
        self, urls: dict[str, list[str]], port: int, model_dir: Path | None = None
    ) -> list[str]:
        """argv of the router over `urls` (role -> instance base URLs). Under kv_aware the
        router gets the instances' tokenizer (`model_dir`), to match text prompts too."""
        cmd = [sys.executable, "-m", "disagg.cli", "route", "--mode", self.mode]
        cmd += ["--policy", self.policy, "--host", self.host, "--port", str(port)]
        if self.policy == "kv_aware" and model_dir is not None:
            cmd += ["--tokenizer", str(model_dir)]
        if self.local_prefill_tokens:
            cmd += ["--local-prefill-tokens", str(self.local_prefill_tokens)]
        if urls.get("prefill"):
            cmd += ["--prefill", *urls["prefill"]]
        # The router follows the decode instances' failure policy: under recompute it also
        # sends a request whose prefill instance died to a decode instance whole.
        policy = _flag_value([*self.serve_args, *self.decode_args], "--failure-policy")
        cmd += ["--failure-policy", policy] if policy else []
        cmd += ["--decode", *urls.get("decode", []), *urls.get("both", [])]
        return cmd + list(self.router_args)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value given to `flag` in args (`--flag V` or `--flag=V`), or None."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def _check_choice(name: str, value: object, kind: Any) -> None:
    if value not in get_args(kind):
        raise ValueError(f"{name} must be one of {list(get_args(kind))}, got {value!r}")


def _check_not_owned(name: str, args: tuple[str, ...]) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_SERVE_FLAGS:
            raise ValueError(f"{name} must not set {flag}: the launcher sets it on every instance")


def load_toml(path: str | Path) -> dict[str, Any]:
    """A cluster TOML file -> ClusterConfig field values; unknown keys raise ValueError."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    known = {f.name for f in fields(ClusterConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
    values = dict(raw)
    for name in _ARGS_FIELDS:
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    for name in ("log_dir", "api_key_file"):
        if isinstance(values.get(name), str):
            values[name] = Path(values[name])
    return values


def merge_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> ClusterConfig:
    """Defaults < file < flags. A flag value of None means "not given on the command line".

    `serve_args` from flags are appended to the file's: `disagg serve` keeps the last copy of a
    repeated flag, so the command line still wins.
    """
    values = dict(file_values)
    extra = tuple(flag_values.get("serve_args") or ())
    values.update({k: v for k, v in flag_values.items() if v is not None and k != "serve_args"})
    base = values.get("serve_args", ())
    if extra and isinstance(base, tuple):  # a mistyped file value is left for validation
        values["serve_args"] = base + extra
    return ClusterConfig(**values)


# --------------------------------------------------------------------------- command line

_FLAG_FIELDS = (
    "mode", "num_prefill", "num_decode", "model", "port", "host", "kv_transport", "policy",
    "local_prefill_tokens",
    "pull_setup", "threads_per_instance", "log_dir", "startup_timeout_s", "serve_args",
    "backend", "ray_address", "api_key_file",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every default is None, so that a flag left out does not override the --config file.
    d = {f.name: f.default for f in fields(ClusterConfig)}
    add = parser.add_argument
    add(
        "--mode", choices=get_args(RouterMode),
        help=f"push / pull: prefill and decode instances; aggregated: instances that do "
        f"both (default: {d['mode']})",
    )  # fmt: skip
    add("--num-prefill", type=int, help="prefill instances (default: 1; 0 when aggregated)")
    add(
        "--num-decode",
        type=int,
        help=f"decode or aggregated instances (default: {d['num_decode']})",
    )
    add("--model", help=f"short name or model directory (default: {d['model']})")
    add("--port", type=int, help=f"router port; 0 = a free one (default: {d['port']})")
    add("--host", help=f"bind address of every process (default: {d['host']})")
    add(
        "--kv-transport", choices=get_args(UpTransport),
        help=f"KV transfer library; auto = nixl when installed (pip install 'disagg[nixl]'), "
        f"else tcp (default: {d['kv_transport']})",
    )  # fmt: skip
    add(
        "--policy", choices=get_args(PolicyName),
        help=f"the router's choice of instance (default: {d['policy']})",
    )  # fmt: skip
    add(
        "--local-prefill-tokens", type=int,
        help="P/D under kv_aware: a request the chosen decode instance lacks at most this many "
        "prompt tokens of is prefilled there, without a prefill instance; 0 = never "
        f"(default: {d['local_prefill_tokens']})",
    )  # fmt: skip
    add(
        "--pull-setup",
        choices=get_args(PullSetup),
        help="pull: decode instances build descriptors and post READs on their own thread "
        f"(background) or on the engine loop, as vLLM (inline) (default: {d['pull_setup']})",
    )
    add(
        "--threads-per-instance", type=int,
        help=f"torch threads of each instance (default: {d['threads_per_instance']})",
    )  # fmt: skip
    add("--config", type=Path, metavar="TOML", help="cluster file; flags given here win over it")
    add("--log-dir", type=Path, help="one log file per process (default: a fresh temp dir)")
    add(
        "--api-key-file", type=Path, metavar="PATH",
        help="clients must send 'Authorization: Bearer KEY' with the key in this file, to the "
        "router and every instance (default: $DISAGG_API_KEY, else open); the children get it "
        "in their environment, never on a command line",
    )  # fmt: skip
    add(
        "--backend", choices=get_args(Backend),
        help="local: child processes of this command; ray: Ray actors, restarted by Ray if "
        "they die (pip install 'disagg[ray]') (default: local)",
    )  # fmt: skip
    add(
        "--address", dest="ray_address", metavar="RAY_ADDRESS",
        help="with --backend ray: the Ray cluster to join (default: start a local one)",
    )  # fmt: skip
    add(
        "--startup-timeout-s", type=float,
        help=f"seconds to wait for every process to be ready (default: {d['startup_timeout_s']:g})",
    )  # fmt: skip
    add("serve_args", nargs="*", metavar="-- SERVE_FLAG", help="flags for every `disagg serve`")


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """Parsed flags (+ the --config file) -> ClusterConfig. ValueError/OSError on bad input."""
    file_values = load_toml(args.config) if args.config is not None else {}
    return merge_config(file_values, {name: getattr(args, name) for name in _FLAG_FIELDS})
