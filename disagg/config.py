"""Frozen, validated configuration for every component; CLI flags derive from these fields.

This is the only module that reads environment variables. No torch here.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = [
    "API_KEY_ENV",
    "BODY_TIMEOUT_S",
    "HEADER_TIMEOUT_S",
    "CacheConfig",
    "EngineConfig",
    "KVTransferConfig",
    "RouterConfig",
    "SchedulerConfig",
    "ServerConfig",
    "cache_dir",
    "env_cluster_token",
    "field_help",
    "limit_native_caches",
    "resolve_api_key",
]

CLUSTER_TOKEN_ENV = "DISAGG_CLUSTER_TOKEN"
API_KEY_ENV = "DISAGG_API_KEY"
_MIN_TOKEN_CHARS = 16
# HTTP deadlines of instances and the router. A client on a slow link still sends headers in a
# second and 16 MiB of body (the default size limit) in 30 s at ~0.5 MB/s.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0

# oneDNN's primitive cache and ideep's LRU of linear primitives (PyTorch's CPU GEMMs) keep up to
# 1024 primitives each, keyed by shape, ~0.3 MB apiece. A prefill step has a new row count
# nearly every time, so a prefill instance grew by ~700 MB until both were full (decode steps
# repeat a few batch sizes and stayed flat). 64 keeps a decode batch's shapes warm through
# prefill steps between them; measured: no throughput difference from 1024.
_NATIVE_CACHE_CAPACITY = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}

Role = Literal["both", "prefill", "decode"]
ConnectorName = Literal["pull", "push"]
# auto: NIXL when it is installed, else TCP (resolved once per process, and logged).
TransportName = Literal["auto", "nixl", "tcp", "local"]
FailurePolicy = Literal["fail", "recompute"]
PullSetup = Literal["background", "inline"]
RouterMode = Literal["aggregated", "pull", "push"]
PolicyName = Literal["round_robin", "least_loaded", "kv_aware"]
EngineChoice = Literal["auto", "disagg", "vllm"]  # the engines a router can drive
AttentionBackend = Literal["auto", "native", "torch"]


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


def limit_native_caches() -> None:
    """Cap the per-shape primitive caches of the CPU GEMM libraries (values the operator set in
    the environment win). Both read the capacity once, at the process's first oneDNN call, so
    this must run before any: the model runner calls it first thing."""
    for name, value in _NATIVE_CACHE_CAPACITY.items():
        os.environ.setdefault(name, value)


def resolve_api_key(flag_value: str, file_path: str | Path | None) -> str:
    """The clients' API key: `--api-key`, else the contents of `--api-key-file`, else
    $DISAGG_API_KEY, else "" (the API is open). A file or the environment keeps the key out of
    the process list, which every user of the host can read; `disagg up` hands it to its
    children in the environment. ValueError (never showing the key) for both flags at once,
    or a file that cannot be read or is empty."""
    if flag_value and file_path is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if flag_value:
        return flag_value
    if file_path is None:
        return os.environ.get(API_KEY_ENV, "")
    try:
        key = Path(file_path).read_text().strip()  # `echo KEY > file` adds a newline
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the API key file {file_path}: {exc}") from exc
    if not key:
        raise ValueError(f"the API key file {file_path} is empty")
    return key


def _check_token(owner: str, token: str, *, is_required: bool) -> None:
    if token and len(token) < _MIN_TOKEN_CHARS:
        raise ValueError(f"cluster_token must have at least {_MIN_TOKEN_CHARS} characters")
    if is_required and not token:
        raise ValueError(
            f"{owner} needs a cluster token (--cluster-token or ${CLUSTER_TOKEN_ENV}; "
            "`disagg up` makes one): it signs every internal call between the instances"
        )


def _check_files(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value and not Path(value).is_file():
            raise ValueError(f"{name} must name a readable file, got {value!r}")


def _check_tls(obj: object, cert_file: str, key_file: str) -> None:
    """A certificate and its key come together, and both must exist."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("tls_cert_file and tls_key_file must be given together")
    _check_files(obj, "tls_cert_file", "tls_key_file")


def _check_url(name: str, value: str) -> None:
    """Empty, or an http(s) URL with a host (signed calls name its host and port)."""
    if not value:
        return
    try:
        parts = urllib.parse.urlsplit(value)
        is_ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        is_ok = is_ok and (parts.port is None or parts.port > 0)
    except ValueError:  # a port that is not a number
        is_ok = False
    if not is_ok:
        raise ValueError(f"{name} must look like http://host:port, got {value!r}")


def _check_choice(name: str, value: object, kind: Any) -> None:
    allowed = get_args(kind)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_not_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


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
    # D frees a reservation P never wrote. It covers P's queue and prefill, which at a loaded P
    # take minutes (measured: a 3k-token prompt at 0.06 req/s on a CPU waited > 30 s, and its
    # request failed); a dead P is caught sooner (the router cuts D's leg). SGLang waits 300 s.
    reservation_timeout_s: float = 300.0
    transfer_timeout_s: float = 20.0  # a posted transfer that has not finished by then fails
    failure_policy: FailurePolicy = "fail"  # on a failed transfer: error, or prefill on D
    # Pull, decode side: where descriptors are built and the READ posted and polled.
    # inline = on the engine loop (vLLM's pull); background = on its own thread.
    pull_setup: PullSetup = "background"
    # The cluster's shared secret: signs internal calls, authenticates KV peers (never logged).
    cluster_token: str = field(default="", repr=False)
    # Internal TLS: the CA (PEM) peers' and the router's certificates chain to. Set, the KV side
    # channel and registrations go over HTTPS, so every instance must serve it (tls_cert_file).
    tls_ca_file: str = ""

    def __post_init__(self) -> None:
        _check_files(self, "tls_ca_file")
        _check_choice("role", self.role, Role)
        _check_choice("connector", self.connector, ConnectorName)
        _check_choice("transport", self.transport, TransportName)
        _check_choice("failure_policy", self.failure_policy, FailurePolicy)
        _check_choice("pull_setup", self.pull_setup, PullSetup)
        _check_positive(self, "lease_s", "reservation_timeout_s", "transfer_timeout_s")
        _check_token(f"a {self.role} instance", self.cluster_token, is_required=self.role != "both")

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
    # Decode attention: auto = our paged kernel where it runs (CPU, bf16/fp32, a compiler to
    # build it), else torch; native = the kernel or refuse to start; torch = gather + SDPA/GEMM.
    attention_backend: AttentionBackend = "auto"
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
        _check_choice("attention_backend", self.attention_backend, AttentionBackend)
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
    # Text / chat prompts longer than this get HTTP 400 before they are tokenized;
    # 0 = max_model_len x 16 (disagg.server.prompt_limits.PROMPT_CHARS_PER_TOKEN).
    max_prompt_chars: int = 0
    router_url: str = ""  # register with this router and heartbeat; "" = be listed statically
    advertise_url: str = ""  # the URL the router reaches us at; "" = http://host:port
    heartbeat_s: float = 1.0  # between registrations; the router drops us after its timeout
    drain_timeout_s: float = 60.0  # on SIGTERM with a router: wait this long for work to end
    header_timeout_s: float = HEADER_TIMEOUT_S  # a request's headers, then the connection closes
    body_timeout_s: float = BODY_TIMEOUT_S  # a request's whole body, then HTTP 408
    tls_cert_file: str = ""  # PEM certificate: serve HTTPS (internal TLS; see disagg.security.tls)
    tls_key_file: str = ""  # its private key (PEM)

    def __post_init__(self) -> None:
        _check_url("advertise_url", self.advertise_url)
        _check_tls(self, self.tls_cert_file, self.tls_key_file)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        _check_positive(self, "max_request_bytes", "heartbeat_s", "drain_timeout_s",
                        "header_timeout_s", "body_timeout_s")  # fmt: skip
        _check_not_negative(self, "max_prompt_chars")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    mode: RouterMode = "aggregated"  # aggregated: decode_urls serve whole requests
    policy: PolicyName = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8000
    # The URL instances reach the router at when it is not host:port (a Service, a proxy):
    # their signed calls name it, and the router accepts only calls signed for itself.
    advertise_url: str = ""
    load_poll_interval_s: float = 0.05  # how often least_loaded refreshes /load
    request_timeout_s: float = 600.0
    api_key: str = field(default="", repr=False)  # clients' bearer key; "" = open
    cluster_token: str = field(default="", repr=False)  # signs the legs and aborts
    max_request_bytes: int = 16 * 1024 * 1024
    # Text / chat prompts longer than this get HTTP 400 here, before a leg is sent (the router
    # has no tokenizer). The default is an instance's own bound at a 128k-token context
    # (131072 x 16 characters); an instance refuses less by its max_model_len. 0 = no check.
    max_prompt_chars: int = 131072 * 16
    # When a prefill instance fails before anything was streamed: "fail" answers the error,
    # "recompute" sends the request whole to a decode instance (it prefills itself).
    failure_policy: FailurePolicy = "fail"
    # A registered instance (`disagg serve --router`) is dropped after this long without a
    # heartbeat; instances named in prefill_urls / decode_urls never are.
    heartbeat_timeout_s: float = 3.0
    # Follow every instance's prefix cache (GET /kv/events, signed) into an index of at most
    # this many block digests, for placement that knows where the KV is; 0 = off, or 65536
    # (about 25 MB) under policy kv_aware.
    kv_index_max_blocks: int = 0
    # kv_aware: what one request already on an instance weighs against prompt tokens to compute
    # (its cost: uncached prompt tokens + queued prefill tokens + this x requests there).
    # Small: a conversation that hops to balance load recomputes its history there; 16 beat 64
    # and 256 on output tok/s in benchmarks/multiturn_bench.py (docs/results/README.md).
    kv_aware_request_tokens: int = 16
    # P/D under kv_aware: a request whose prompt the best decode instance lacks at most this
    # many tokens of is sent to that instance whole (it prefills them itself, no handoff);
    # 0 = always disaggregate. benchmarks/multiturn_bench.py measures the choice.
    local_prefill_tokens: int = 0
    # A tokenizer.json or model directory: lets kv_aware match text and chat prompts (token-id
    # prompts need none). It must be the instances' tokenizer, or nothing will match.
    tokenizer: str = ""
    header_timeout_s: float = HEADER_TIMEOUT_S  # a client's request headers, then we hang up
    body_timeout_s: float = BODY_TIMEOUT_S  # a client's whole body, then HTTP 408
    # A leg that never reached its instance (connection refused) goes to another one, at most
    # max_retries times per request, after retry_backoff_s doubling up to retry_max_backoff_s;
    # never once a byte was relayed to the client. 0 = no retries.
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0
    # An instance that failed breaker_failures legs in a row (unreachable, broken, timed out,
    # or 502/503/504) takes no work for breaker_cooldown_s, then one leg probes it. 0 = off.
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    # Admission: at most max_concurrent_requests client requests in flight (0 = no limit); up
    # to max_queued_requests more wait for a slot (beyond: 429), each for at most
    # queue_timeout_s (then 503).
    max_concurrent_requests: int = 0
    max_queued_requests: int = 64
    queue_timeout_s: float = 30.0
    # Internal TLS (disagg.security.tls): serve HTTPS with this certificate and key, and verify the
    # instances' certificates against this CA (PEM files; "" = plain HTTP, system CAs).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    # Which kind of instance the router drives: "auto" tells each instance's kind from what it
    # answers (ours: /kv_info; vLLM: /version); "disagg" or "vllm" accept only that kind.
    engine: EngineChoice = "auto"
    # vLLM instances' NIXL identities, "URL=ENGINE_ID@HOST:PORT[,tp=N]": a push router names
    # the prefill side's on each decode leg (else read from vLLM's dev-mode /server_info).
    vllm_side_channels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_url("advertise_url", self.advertise_url)
        _check_choice("engine", self.engine, EngineChoice)
        _check_tls(self, self.tls_cert_file, self.tls_key_file)
        _check_files(self, "tls_ca_file")
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
            "heartbeat_timeout_s", "header_timeout_s", "body_timeout_s",
        )  # fmt: skip
        _check_not_negative(self, "max_prompt_chars", "kv_index_max_blocks",
                            "kv_aware_request_tokens", "local_prefill_tokens")  # fmt: skip
        if (self.kv_index_max_blocks or self.policy == "kv_aware") and not self.cluster_token:
            raise ValueError("kv_aware and kv_index_max_blocks need the cluster token: they "
                             "follow the instances' /kv/events, a signed route")  # fmt: skip
        _check_resilience(self)
        # vLLM's legs are not signed calls of ours: only our instances need the token.
        _check_token("a pull or push router", self.cluster_token,
                     is_required=self.mode != "aggregated" and self.engine != "vllm")  # fmt: skip


def _check_resilience(cfg: RouterConfig) -> None:
    _check_not_negative(
        cfg, "max_retries", "breaker_failures", "max_concurrent_requests", "max_queued_requests"
    )
    _check_positive(cfg, "retry_backoff_s", "breaker_cooldown_s", "queue_timeout_s")
    if cfg.retry_max_backoff_s < cfg.retry_backoff_s:
        raise ValueError(
            f"retry_max_backoff_s must be >= retry_backoff_s ({cfg.retry_backoff_s}), "
            f"got {cfg.retry_max_backoff_s}"
        )


def field_help(cls: type) -> dict[str, tuple[Any, str]]:
    """Field name -> (default, type name), for deriving CLI flags from a config class."""
    out: dict[str, tuple[Any, str]] = {}
    for f in fields(cls):
        default = f.default if f.default is not MISSING else None
        out[f.name] = (default, str(f.type))
    return out
