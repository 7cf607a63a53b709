"""Who an instance is on the KV side, for either engine the router drives.

Two engines (`EngineKind`): `disagg` (our own `disagg serve`: `GET /kv_info` answers `KVInfo`) and
`vllm` (vLLM with its `NixlConnector` for pull or `NixlPushConnector` for push: no `/kv_info`,
`GET /version` names it). A push router must know a vLLM prefill instance's engine id, NIXL
side channel and TP size before it sends the legs; they come from vLLM's `/server_info` (served
when vLLM runs with VLLM_SERVER_DEV_MODE=1) or from the operator (`--vllm-side-channel`).
Pure parsing here; instances.py fetches. Must not send legs (legs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import yarl

__all__ = [
    "VLLM_CONNECTORS",
    "EngineKind",
    "Identity",
    "KVInfo",
    "VLLMIdentity",
    "parse_side_channel",
]

EngineKind = Literal["disagg", "vllm"]

# vLLM's kv_connector names for each router mode (NixlConnector is NixlPullConnector's old name).
VLLM_CONNECTORS: dict[str, frozenset[str]] = {
    "pull": frozenset({"NixlConnector", "NixlPullConnector"}),
    "push": frozenset({"NixlPushConnector"}),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVInfo:
    """One of our instances' `GET /kv_info`: who it is on the KV side channel."""

    role: str  # "prefill" | "decode" | "both"
    engine_id: str | None = None
    connector: str | None = None  # "pull" | "push"; None when role is "both"
    kv_host: str | None = None  # KV side-channel address peers connect to
    kv_port: int | None = None
    block_size: int | None = None  # tokens per KV block
    model: str | None = None
    engine: EngineKind = "disagg"

    @classmethod
    def from_dict(cls, raw: Any) -> KVInfo:
        if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
            raise ValueError(f"kv_info must be an object with a string role, got {raw!r}")
        port = raw.get("kv_port")
        if port is not None and type(port) is not int:
            raise ValueError(f"kv_info.kv_port must be an integer, got {port!r}")
        names = ("engine_id", "connector", "kv_host", "block_size", "model")
        return cls(role=raw["role"], kv_port=port, **{n: raw.get(n) for n in names})

    @property
    def is_addressable(self) -> bool:
        """True when a peer can reach this instance's KV (push needs it of P)."""
        return bool(self.engine_id) and bool(self.kv_host) and self.kv_port is not None

    def describe(self) -> str:
        return f"disagg {self.role}, connector {self.connector}, engine {self.engine_id}"


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMIdentity:
    """A vLLM instance: its version, and where known its KV connector's identity (what vLLM's
    push decode leg must name: the prefill side's engine id, NIXL side channel and TP size)."""

    version: str
    connector: str | None = None  # kv_transfer_config.kv_connector; None = not told
    engine_id: str | None = None  # kv_transfer_config.engine_id
    kv_host: str | None = None  # VLLM_NIXL_SIDE_CHANNEL_HOST
    kv_port: int | None = None  # VLLM_NIXL_SIDE_CHANNEL_PORT
    tp_size: int = 1
    source: str = "version only"  # where the KV identity came from, for the logs
    engine: EngineKind = "vllm"

    @property
    def is_addressable(self) -> bool:
        return bool(self.engine_id) and bool(self.kv_host) and self.kv_port is not None

    def with_server_info(self, raw: Any) -> VLLMIdentity:
        """The identity `/server_info?config_format=json` tells (ValueError if malformed)."""
        try:
            config, env = raw["vllm_config"], raw["vllm_env"]
            kv = config.get("kv_transfer_config") or {}
            tp_size = config["parallel_config"]["tensor_parallel_size"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"vLLM /server_info lacks {exc}") from exc
        port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
        return VLLMIdentity(
            version=self.version,
            connector=_str_or_none(kv.get("kv_connector"), "kv_connector"),
            engine_id=_str_or_none(kv.get("engine_id"), "engine_id"),
            kv_host=_str_or_none(env.get("VLLM_NIXL_SIDE_CHANNEL_HOST"), "side channel host"),
            kv_port=_port(port),
            tp_size=_positive(tp_size, "tensor_parallel_size"),
            source="/server_info",
        )

    def with_declared(self, declared: VLLMIdentity) -> VLLMIdentity:
        """The operator's declaration (`--vllm-side-channel`) for this instance."""
        return VLLMIdentity(
            version=self.version,
            connector=self.connector,
            engine_id=declared.engine_id,
            kv_host=declared.kv_host,
            kv_port=declared.kv_port,
            tp_size=declared.tp_size,
            source="--vllm-side-channel",
        )

    def describe(self) -> str:
        where = f"{self.kv_host}:{self.kv_port}" if self.is_addressable else "unknown"
        connector = self.connector or "not told"
        return (f"vLLM {self.version}, connector {connector}, engine {self.engine_id}, "
                f"side channel {where} tp {self.tp_size} ({self.source})")  # fmt: skip


Identity = KVInfo | VLLMIdentity


def parse_side_channel(spec: str) -> tuple[str, VLLMIdentity]:
    """`URL=ENGINE_ID@HOST:PORT[,tp=N]` -> (the instance's base URL, its declared identity):
    a vLLM instance's NIXL side channel, for a push router when vLLM serves no /server_info.
    The URL is returned as written (the caller normalizes it). ValueError names the problem."""
    url, sep, rest = spec.partition("=")
    if not sep or not url:
        raise ValueError(f"--vllm-side-channel must be URL=ENGINE_ID@HOST:PORT, got {spec!r}")
    address, _, options = rest.partition(",")
    engine_id, at, host_port = address.partition("@")
    host, colon, port = host_port.rpartition(":")
    if not (at and engine_id and colon and host):
        raise ValueError(f"--vllm-side-channel must be URL=ENGINE_ID@HOST:PORT, got {spec!r}")
    tp_size = 1
    if options:
        name, _, value = options.partition("=")
        if name != "tp" or not value.isdigit():
            raise ValueError(f"--vllm-side-channel options are ',tp=N', got {options!r}")
        tp_size = _positive(int(value), "tp")
    try:
        yarl.URL.build(host=host.strip("[]"))
    except ValueError as exc:
        raise ValueError(f"--vllm-side-channel host {host!r} is not a host name") from exc
    declared = VLLMIdentity(version="declared", engine_id=engine_id, kv_host=host,
                            kv_port=_port(int(port) if port.isdigit() else port),
                            tp_size=tp_size, source="--vllm-side-channel")  # fmt: skip
    return url, declared


def _str_or_none(value: Any, name: str) -> str | None:
    if value is None or (isinstance(value, str) and 0 < len(value) <= 256):
        return value
    raise ValueError(f"vLLM {name} must be a string of 1-256 characters, got {value!r}")


def _port(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 < value < 65536:
        raise ValueError(f"a NIXL side-channel port must be in 1..65535, got {value!r}")
    return value


def _positive(value: Any, name: str) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value
