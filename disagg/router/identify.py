"""Telling which kind of instance answers at a URL, and whether this router can drive it.

Detected, never guessed: ours answers `GET /kv_info`; vLLM answers 404 there and names itself
on `GET /version`. A vLLM instance's KV identity comes from what the operator declared
(`--vllm-side-channel`), else from its `/server_info` (VLLM_SERVER_DEV_MODE=1). `refusal` says
why an identified instance must not take work (its kind, connector or missing side channel);
the pool keeps such an instance out and shows the reason. Must not hold state (instances.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from disagg.config import EngineChoice
from disagg.router.identity import (
    VLLM_CONNECTORS,
    EngineKind,
    Identity,
    KVInfo,
    VLLMIdentity,
)

__all__ = ["Getter", "identify", "mismatch_warning", "refusal"]

# GET path -> (status, the answer's JSON, None when it is not JSON). Raises on no answer.
Getter = Callable[[str], Awaitable[tuple[int, Any]]]
_SERVER_INFO = "/server_info?config_format=json"


async def identify(
    get: Getter, choice: EngineChoice, declared: VLLMIdentity | None = None
) -> Identity:
    """The instance's identity. `choice`: auto detects; disagg or vllm only accept that kind.
    Raises ValueError when the instance is of neither kind (or not of the chosen one)."""
    if choice != "vllm":
        status, raw = await get("/kv_info")
        if status == 200:
            return KVInfo.from_dict(raw)
        if choice == "disagg" or status != 404:
            raise ValueError(f"GET /kv_info answered {status}: not a disagg instance")
    status, raw = await get("/version")
    version = raw.get("version") if isinstance(raw, dict) else None
    if status != 200 or not isinstance(version, str):
        if choice == "vllm":
            missing = "no vLLM /version answers (--engine vllm)"
        else:
            missing = "neither disagg's /kv_info nor vLLM's /version answers"
        raise ValueError(f"{missing}: not an instance this router drives")
    found = VLLMIdentity(version=version[:64])
    status, raw = await get(_SERVER_INFO)
    if status == 200:  # vLLM in dev mode: its connector, engine id and side channel
        found = found.with_server_info(raw)
    return found if declared is None else found.with_declared(declared)


def refusal(
    identity: Identity, role: str, mode: str, choice: EngineChoice, others: Collection[EngineKind]
) -> str | None:
    """Why this router must not send `identity`'s instance work in `mode` as `role`, or None.
    `others`: the kinds of the instances it already drives (one router drives one kind)."""
    kind = identity.engine
    if choice != "auto" and kind != choice:
        return f"it is a {kind} instance and the router drives {choice} (--engine)"
    if others and kind not in others:
        return (f"it is a {kind} instance and the router already drives "
                f"{'/'.join(sorted(others))} ones; run one router per kind")  # fmt: skip
    if not isinstance(identity, VLLMIdentity) or mode == "aggregated":
        return None
    wanted = VLLM_CONNECTORS[mode]
    if identity.connector is not None and identity.connector not in wanted:
        return (f"it runs vLLM's {identity.connector}; a {mode} router needs "
                f"{' or '.join(sorted(wanted))}")  # fmt: skip
    if mode == "push" and role == "prefill" and not identity.is_addressable:
        return ("its NIXL engine id and side channel are unknown (push names them on the "
                "decode leg): start vLLM with VLLM_SERVER_DEV_MODE=1, or declare "
                "--vllm-side-channel URL=ENGINE_ID@HOST:PORT")  # fmt: skip
    return None


def mismatch_warning(identity: Identity, role: str, mode: str) -> str | None:
    """What is odd but not refused about one of our instances (kept as warnings: an operator
    may relabel an instance while it runs)."""
    if not isinstance(identity, KVInfo):
        return None
    if identity.role != role:
        return f"is listed as {role} but reports {identity.role}"
    if role != "both" and identity.connector not in (None, mode):
        return f"runs connector {identity.connector}, router mode is {mode}"
    return None
