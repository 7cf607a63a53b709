"""Push (early binding), as vLLM's push connector, SGLang and Mooncake do it, in two halves.

`PushScheduler` (pure): a decode request's reserved blocks become a receive, a finished
prefill with a transfer id a send, for the worker.
`PushWorker` (transport, threads, side channel) never asks which role it serves: as pull hands
reads to its reader, it hands decode-side work to its receiver (push_receiver.py: reserved
blocks registered with P from a call thread, ended by P's `write_done`) and prefill-side work
to its writer (push_writer.py: the `kv-push-writer` thread pairs registrations with finished
prefills in either order, writes, frees P's blocks when it settles). Neither engine loop ever
blocks on a transfer.
"""

from __future__ import annotations

import time
from typing import Any

from disagg.engine.kv_connector import KVConnectorMeta, KVConnectorScheduler
from disagg.engine.outputs import KVConnectorOutput
from disagg.engine.request import Request
from disagg.kv.common import ConnectorBase, KVIdentity, SideChannelError, SideHandler
from disagg.kv.push_receiver import PushReceiver
from disagg.kv.push_writer import PushWriter
from disagg.protocol import KVTransferParams

__all__ = ["PushScheduler", "PushWorker"]

_MAX_REGISTRATION_TTL_S = 3600.0  # a registration P keeps longer than this is a mistake
_NOTIFY_POLL_S = 0.0005  # slowest poll while a reservation waits: write_done is on the TTFT path


# ================================================================== scheduler half (pure)


class PushScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, identity: KVIdentity) -> None:
        super().__init__(block_size)
        self.identity = identity

    def accepts(self, params: KVTransferParams) -> bool:
        return bool(params.transfer_id)  # no transfer id: no decode instance awaits the KV

    def finished_params(self, request: Request, blocks: list[int], first: int) -> KVTransferParams:
        assert request.kv_transfer_params is not None
        return KVTransferParams(
            transfer_id=request.kv_transfer_params.transfer_id,
            remote_engine_id=self.identity.engine_id,
            num_prompt_tokens=request.num_prompt_tokens,
            first_token_id=first,
            connector="push",
        )


# ================================================================== worker half


class PushWorker(ConnectorBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver = PushReceiver(self)  # decode side: reservations
        self.writer = PushWriter(self, self._control, self._stopping)  # prefill side: writes

    def start(self) -> None:
        super().start()
        self.writer.start()

    def side_channel(self) -> dict[str, SideHandler]:
        return {
            **super().side_channel(),
            "/kv/register": self._handle_register,
            "/kv/cancel": self._handle_cancel,
        }

    def listen_cap_s(self) -> float:
        return _NOTIFY_POLL_S if self.receiver.has_pending() else super().listen_cap_s()

    # ------------------------------------------------------------------ engine loop

    def start_load(self, meta: KVConnectorMeta) -> None:
        """Hand the step's work to the call threads or the writer (no I/O here)."""
        for receive in meta.receives:
            self.receiver.reserve(receive)
        for send in meta.sends:
            self.writer.prefill_done(send)
        for request_id in meta.aborts:  # a side with a write in flight settles it later
            if not (self.writer.abort(request_id) or self.receiver.abort(request_id)):
                self.report(settled=request_id)  # nothing can land: the blocks go now

    def get_finished(self) -> KVConnectorOutput:
        self.receiver.expire(time.monotonic())
        return self.take_reports()

    def blocks_in_use(self) -> set[int]:
        return self.writer.blocks_in_use() | self.receiver.blocks_in_use()

    def has_pending(self) -> bool:
        return self.writer.has_pending() or self.receiver.has_pending()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "pending": {**self.writer.pending(), **self.receiver.pending()}}

    # ------------------------------------------------------------------ side channel, listener

    async def _handle_register(self, body: dict[str, Any]) -> dict[str, Any]:
        """Prefill side: a decode instance reserved blocks for a transfer."""
        try:
            tid, peer = str(body["transfer_id"]), str(body["engine_id"])
            block_ids = [int(b) for b in body["block_ids"]]
            ttl_s = float(body.get("ttl_s", self.kv_config.lease_s))
            first_block = int(body.get("first_block", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise SideChannelError(400, f"bad registration: {exc}") from exc
        if not 0 < ttl_s <= _MAX_REGISTRATION_TTL_S:  # NaN fails too
            raise SideChannelError(400, f"ttl_s must be in (0, {_MAX_REGISTRATION_TTL_S}]")
        if first_block < 0:
            raise SideChannelError(400, "first_block must be >= 0")
        self.writer.register(tid, peer, block_ids, ttl_s, first_block)
        return {"status": "registered"}

    async def _handle_cancel(self, body: dict[str, Any]) -> dict[str, Any]:
        """Prefill side: answers once no write for the transfer can land any more."""
        try:
            tid = str(body["transfer_id"])
        except (KeyError, TypeError) as exc:
            raise SideChannelError(400, f"bad cancel: {exc}") from exc
        return {"state": await self.writer.cancel(tid, self.kv_config.transfer_timeout_s + 5)}

    def on_message(self, peer: str, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "write_done":
            self.receiver.on_write_done(message)
        elif kind == "write_failed":
            self.receiver.on_write_failed(message)
