"""What two instances must agree on before KV bytes move, and the messages they exchange.

Pure Python: the compatibility record, the check that names the first mismatch, and the JSON
notification messages that ride on transfers (`read_done`, `write_done`, `write_failed`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Compat", "decode_message", "encode_message"]

KV_LAYOUT = "blocks[num_blocks,num_layers,2,num_kv_heads,block_size,head_dim]/v2"


@dataclass(frozen=True, slots=True)
class Compat:
    """Everything that changes the bytes of a KV block or how the two legs pair up."""

    model: str  # architecture + shape fingerprint (names differ across hosts; shapes must not)
    dtype: str
    block_size: int
    block_nbytes: int
    layout: str
    connector: str  # pull | push: both sides must run the same protocol
    transport: str  # nixl | tcp | local, resolved ("auto" may pick nixl here and tcp there)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Compat:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__})

    def mismatch(self, other: Compat, *, mine: str, theirs: str) -> str | None:
        """None if compatible, else a sentence naming the first differing field."""
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"incompatible KV peer: {name} differs ({mine} {a!r}, {theirs} {b!r})"
        return None


def encode_message(kind: str, **fields: Any) -> bytes:
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def decode_message(raw: bytes) -> dict[str, Any] | None:
    """A notification from a peer, or None if it is not one of ours (never raises)."""
    try:
        message = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return message if isinstance(message, dict) and "kind" in message else None
