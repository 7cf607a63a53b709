"""`kv_transfer_params` as vLLM's NIXL connectors read them, for the legs the router sends to vLLM
instances (field names from vLLM 0.32's `nixl/base_scheduler.py`, `push_scheduler.py` and
`metadata.py`).

Pull (`NixlConnector`): P's leg asks it to keep the KV (`do_remote_decode`); P's answer names
its blocks, and D's leg carries that answer's params as vLLM wrote them, checked first: a D leg
whose params lack a field vLLM indexes (`remote_request_id`, ...) kills vLLM's engine core.
Push (`NixlPushConnector`): both legs at once under one X-Request-Id, which is how vLLM pairs
them (P matches D's registration to its finished prefill by that id, less vLLM's random
suffix); D's leg names P's engine id, side channel and TP size. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.router.identity import VLLMIdentity

__all__ = ["VLLMParams"]

# What vLLM's decode side indexes in a D leg's params, and the types it needs.
_DECODE_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_block_ids": (list, tuple),
}
_MAX_FIELDS = 64  # in P's answer's params; a bigger object is not vLLM's


@dataclass(frozen=True, slots=True)
class VLLMParams:
    """One leg's `kv_transfer_params` for a vLLM instance, as sent on the wire."""

    fields: dict[str, Any] = field(default_factory=dict)

    def to_sparse_dict(self) -> dict[str, Any]:
        """The wire form (vLLM reads `do_remote_*` by truth, so False values stay)."""
        return dict(self.fields)

    @classmethod
    def prefill(cls) -> VLLMParams:
        """P's leg, pull and push alike: keep the prompt's KV for a decode instance."""
        return cls({"do_remote_decode": True, "do_remote_prefill": False})

    @classmethod
    def push_decode(cls, prefill: VLLMIdentity, request_id: str) -> VLLMParams:
        """D's push leg: which prefill instance will write into its blocks. `request_id` is
        the id both legs carry; vLLM's decode side needs a `remote_request_id` (it keys its
        lease heartbeats) though P's own id is not known before P answers."""
        assert prefill.is_addressable, "push needs the prefill instance's side channel"
        return cls({
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": prefill.engine_id,
            "remote_host": prefill.kv_host,
            "remote_port": prefill.kv_port,
            "tp_size": prefill.tp_size,
            "remote_request_id": request_id,
            "remote_block_ids": [],
        })  # fmt: skip

    @classmethod
    def from_prefill_answer(cls, raw: Any) -> VLLMParams:
        """Pull: P's answer's params, for D's leg as vLLM wrote them. ValueError when a field
        vLLM's decode side indexes is missing or of the wrong type."""
        if not isinstance(raw, dict) or len(raw) > _MAX_FIELDS:
            raise ValueError("kv_transfer_params must be an object of vLLM's fields")
        if raw.get("do_remote_prefill") is not True:
            raise ValueError("kv_transfer_params.do_remote_prefill must be true")
        for name, kind in _DECODE_REQUIRED.items():
            value = raw.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{name} is missing or malformed")
        return cls(dict(raw))

    @property
    def lease_id(self) -> str | None:
        """P's name for the request (vLLM has no route to release a lease early)."""
        value = self.fields.get("remote_request_id")
        return value if isinstance(value, str) else None
