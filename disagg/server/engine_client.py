"""What the HTTP server needs from an engine: the contract between the asyncio side and the loop.

The real implementation is `disagg.engine.async_engine.AsyncEngine` (an engine-loop thread behind
asyncio queues); tests use a fake with the same shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from disagg.protocol import (
    EngineOverloadedError,
    KVTransferParams,
    RequestFencedError,
    RequestIdInUseError,
    RequestOutput,
    SamplingParams,
)

__all__ = ["EngineClient", "EngineOverloadedError", "RequestFencedError", "RequestIdInUseError"]


class EngineClient(Protocol):
    model_name: str  # the name served in /v1/models and checked against `model` in requests
    max_model_len: int  # prompt + max_tokens must fit
    eos_token_ids: tuple[int, ...]
    dtype: str  # the dtype the engine computes in, resolved ("auto" is never shown)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; yields deltas (carrying `request_id`) until one with finish_reason
        set. Raises ValueError for a request the engine refuses; RequestIdInUseError (a
        ValueError) while an earlier request under the same id still streams."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort the latest request under this id (client gone, stop string hit), also once its
        stream ended while the engine still holds it (a lease). Idempotent; frees its blocks."""
        ...

    async def fence(self, request_id: str) -> bool:
        """Abort the request under this id if the engine may hold it (True); else refuse any
        later submission under it for a while (False) -- RequestFencedError, a ValueError."""
        ...

    def load(self) -> dict[str, int]:
        """{"num_running", "num_waiting", "num_free_blocks", "num_total_blocks",
        "num_queued_prefill_tokens"}; cheap, thread-safe snapshot."""
        ...

    def is_healthy(self) -> bool:
        """False once the engine loop died."""
        ...

    def kv_events(self, epoch: str, seq: int) -> dict[str, Any]:
        """The prefix cache's stored/removed digests since (epoch, seq), or a snapshot."""
        ...

    def kv_info(self) -> dict[str, Any]:
        """Identity for peers and the router: {"engine_id", "role", "connector", "kv_host",
        "kv_port", "block_size", ...}; {"role": "both"} when not disaggregated."""
        ...
