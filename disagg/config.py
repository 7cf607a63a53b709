"""Frozen, validated configuration for every component; CLI flags derive from these fields.

This is the only module that reads environment variables. No torch here.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "KVTransferConfig",
    "RouterConfig",
    "SchedulerConfig",
    "ServerConfig",
    "cache_dir",
    "env_cluster_token",
    "field_help",
]

CLUSTER_TOKEN_ENV = "DISAGG_CLUSTER_TOKEN"
_MIN_TOKEN_CHARS = 16

Role = Literal["both", "prefill", "decode"]
ConnectorName = Literal["pull", "push"]
# auto: NIXL when it is installed, else TCP (resolved once per process, and logged).
TransportName = Literal["auto", "nixl", "tcp", "local"]
FailurePolicy = Literal["fail", "recompute"]
PullSetup = Literal["background", "inline"]
RouterMode = Literal["aggregated", "pull", "push"]
PolicyName = Literal["round_robin", "least_loaded"]


def cache_dir() -> Path:
    """Where converted models and generated checkpoints live (DISAGG_CACHE_DIR overrides)."""
    env = os.environ.get("DISAGG_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disagg"


def env_cluster_token() -> str:
    """The cluster secret from the environment ("" when unset): how `disagg up` hands it to
    its children without putting it on a command line that `ps` shows."""
    return os.environ.get(CLUSTER_TOKEN_ENV, "")


def _check_token(owner: str, token: str, *, is_required: bool) -> None:
    if token and len(token) < _MIN_TOKEN_CHARS:
        raise ValueError(f"cluster_token must have at least {_MIN_TOKEN_CHARS} characters")
    if is_required and not token:
        raise ValueError(
            f"{owner} needs a cluster token (--cluster-token or ${CLUSTER_TOKEN_ENV}; "
            "`disagg up` makes one): it signs every internal call between the instances"
        )


def _check_choice(name: str, value: object, kind: Any) -> None:
    allowed = get_args(kind)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunks + decodes)
    max_model_len: int = 4096  # prompt + output tokens per request
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len")


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 1024  # KV blocks in the pool (one tensor; see model_runner)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_positive(self, "num_blocks")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferConfig:
    role: Role = "both"
    connector: ConnectorName = "pull"  # ignored when role == "both"
    transport: TransportName = "auto"
    host: str = "127.0.0.1"  # address peers use to reach this instance (HTTP side channel + KV)
    engine_id: str = ""  # "" = derived from host and port at start
    lease_s: float = 30.0  # P keeps blocks this long for a pull that never comes
    reservation_timeout_s: float = 30.0  # D frees a reservation P never wrote
    transfer_timeout_s: float = 20.0  # a posted transfer that has not finished by then fails
    failure_policy: FailurePolicy = "fail"  # on a failed transfer: error, or prefill on D
    # Pull, decode side: where descriptors are built and the READ posted and polled.
    # inline = on the engine loop (vLLM's pull); background = on its own thread.
    pull_setup: PullSetup = "background"
    # Fault injection for tests and drills: "" | "fail_transfer" (every transfer this instance
    # starts fails) | "delay_register:SECONDS" (push: D registers its blocks late).
    fault: str = ""
    # The cluster's shared secret: signs internal calls, authenticates KV peers (never logged).
    cluster_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        _check_choice("role", self.role, Role)
        _check_choice("connector", self.connector, ConnectorName)
        _check_choice("transport", self.transport, TransportName)
        _check_choice("failure_policy", self.failure_policy, FailurePolicy)
        _check_choice("pull_setup", self.pull_setup, PullSetup)
        _check_positive(self, "lease_s", "reservation_timeout_s", "transfer_timeout_s")
        _check_token(f"a {self.role} instance", self.cluster_token, is_required=self.role != "both")
        if not (self.fault in ("", "fail_transfer") or self.fault.startswith("delay_register:")):
            raise ValueError(
                f"fault must be '', fail_transfer or delay_register:S, got {self.fault!r}"
            )

    @property
    def register_delay_s(self) -> float:
        return (
            float(self.fault.split(":", 1)[1]) if self.fault.startswith("delay_register:") else 0.0
        )

    @property
    def is_disaggregated(self) -> bool:
        return self.role != "both"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: str = "smollm2-135m"  # short name or Hugging Face directory
    served_model_name: str = ""  # "" = the model argument
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # auto (bf16 where the device runs it fast) | float32 | bfloat16 | float16
    seed: int = 0
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = field(default="", repr=False)  # "" = the OpenAI API is open, as vLLM's
    max_request_bytes: int = 16 * 1024 * 1024  # a 128k-token prompt as ids is ~1 MB
    router_url: str = ""  # register with this router and heartbeat; "" = be listed statically
    advertise_url: str = ""  # the URL the router reaches us at; "" = http://host:port
    heartbeat_s: float = 1.0  # between registrations; the router drops us after its timeout
    drain_timeout_s: float = 60.0  # on SIGTERM with a router: wait this long for work to end

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        _check_positive(self, "max_request_bytes", "heartbeat_s", "drain_timeout_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    mode: RouterMode = "aggregated"  # aggregated: decode_urls serve whole requests
    policy: PolicyName = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8000
    load_poll_interval_s: float = 0.05  # how often least_loaded refreshes /load
    request_timeout_s: float = 600.0
    api_key: str = field(default="", repr=False)  # clients' bearer key; "" = open
    cluster_token: str = field(default="", repr=False)  # signs the legs and aborts
    max_request_bytes: int = 16 * 1024 * 1024
    # When a prefill instance fails before anything was streamed: "fail" answers the error,
    # "recompute" sends the request whole to a decode instance (it prefills itself).
    failure_policy: FailurePolicy = "fail"
    # A registered instance (`disagg serve --router`) is dropped after this long without a
    # heartbeat; instances named in prefill_urls / decode_urls never are.
    heartbeat_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        _check_choice("failure_policy", self.failure_policy, FailurePolicy)
        _check_choice("mode", self.mode, RouterMode)
        _check_choice("policy", self.policy, PolicyName)
        # Without a cluster token no instance can register, so the lists must name them.
        if not self.cluster_token and not self.decode_urls:
            raise ValueError(
                "decode_urls must name at least one instance (or set a cluster token and let "
                "instances register with `disagg serve --router URL`)"
            )
        if not self.cluster_token and self.mode != "aggregated" and not self.prefill_urls:
            raise ValueError(f"mode {self.mode} needs at least one prefill url")
        _check_positive(
            self, "load_poll_interval_s", "request_timeout_s", "max_request_bytes",
            "heartbeat_timeout_s",
        )  # fmt: skip
        _check_token("a pull or push router", self.cluster_token,
                     is_required=self.mode != "aggregated")  # fmt: skip


def field_help(cls: type) -> dict[str, tuple[Any, str]]:
    """Field name -> (default, type name), for deriving CLI flags from a config class."""
    out: dict[str, tuple[Any, str]] = {}
    for f in fields(cls):
        default = f.default if f.default is not MISSING else None
        out[f.name] = (default, str(f.type))
    return out
