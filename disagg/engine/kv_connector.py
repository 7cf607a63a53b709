"""The KV connector contract: the hooks the engine calls, whatever the handoff mode.

One object, two roles (as vLLM's): the scheduler side decides and records (pure bookkeeping,
called from `Scheduler`), the worker side moves bytes (called from the engine loop once per
step). The engine never knows whether it runs pull or push.
"""

from __future__ import annotations

import abc

from disagg.engine.outputs import KVConnectorOutput
from disagg.engine.request import Request

__all__ = ["KVConnector"]


class KVConnector(abc.ABC):
    # ------------------------------------------------------------------ scheduler side

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request) -> int:
        """Called once when a waiting request is first scheduled. Returns how many prompt
        tokens will arrive from a remote instance (0 = compute locally). Must not mutate."""

    @abc.abstractmethod
    def on_blocks_allocated(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The scheduler reserved `block_ids` for a request whose KV comes from remote; the
        request is now WAITING_FOR_REMOTE_KV. Record what to load (pull) or register the
        reservation with the prefill instance (push)."""

    @abc.abstractmethod
    def build_meta(self) -> object:
        """Called at the end of schedule(): the work the worker side must start this step
        (or None). Clears what it returns."""

    @abc.abstractmethod
    def request_finished(self, request: Request) -> tuple[bool, dict[str, object] | None]:
        """A request finished computing (or was aborted). Returns (keep_blocks, params):
        keep_blocks=True means the scheduler holds its blocks in WAITING_FOR_KV_SEND until
        a later get_finished() reports it in finished_sending; params go back to the caller
        as `kv_transfer_params`."""

    @abc.abstractmethod
    def request_aborted(self, request: Request) -> bool:
        """A request in WAITING_FOR_REMOTE_KV or WAITING_FOR_KV_SEND leaves that state early
        (aborted, failed, or sent back to prefill locally). Returns True if a transfer
        touching its blocks may still be in flight: the scheduler then keeps the blocks until
        get_finished() reports the id in `settled`, and only then reuses them."""

    # ------------------------------------------------------------------ worker side

    @abc.abstractmethod
    def start_load(self, meta: object) -> None:
        """Start the loads in `meta` (from build_meta) on the engine loop."""

    @abc.abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Non-blocking poll, once per step: transfers finished or failed since last call."""

    @abc.abstractmethod
    def has_pending(self) -> bool:
        """True while any transfer or reservation is outstanding (the loop keeps polling)."""

    def blocks_in_use(self) -> set[int]:
        """Blocks a transfer touches now or may touch later. Invariant (checked by
        Scheduler.check_integrity): each is held by a request or by `draining`, never free."""
        return set()

    def needs_loop_poll(self) -> bool:
        """True while the engine loop must poll transfers itself (it then sleeps only briefly
        between empty steps); False when every result arrives by report() and wake-up."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background threads and release the transport."""
