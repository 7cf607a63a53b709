"""The KV connector contract, in two halves (as vLLM v1 splits its connectors):

- `KVConnectorScheduler`, called by the Scheduler: pure bookkeeping (no threads, no I/O, no
  clock). It decides what a handoff is, answers "may a transfer still touch these blocks?",
  and hands the worker plain ids in a `KVConnectorMeta` once per step.
- `KVConnectorWorker`, called by the Engine on the loop thread (`start_load`, `get_finished`):
  transport, threads, side channel. It reports back only through `KVConnectorOutput`.

The halves share nothing but those two dataclasses; the engine never knows pull from push.

    Scheduler --(KVConnectorMeta: receives, sends, aborts)--> Worker      (once per step)
    Scheduler <--(KVConnectorOutput: finished, failed, settled)-- Worker  (once per step)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.engine.outputs import KVConnectorOutput
from disagg.engine.request import Request, RequestStatus
from disagg.protocol import KVTransferParams

__all__ = [
    "KVConnectorMeta",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVReceive",
    "KVSend",
    "source_blocks",
]


_NOT_SENT = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(frozen=True, slots=True)
class KVReceive:
    """Decode side: blocks reserved for a prompt whose KV comes from a prefill instance."""

    request_id: str
    # Ours, in order: the prompt's blocks from `first_block` on. The ones before it were
    # reused from our own prefix cache; the transfer must neither fill nor touch them.
    block_ids: tuple[int, ...]
    params: KVTransferParams  # the router's: which prefill instance, its blocks or transfer id
    arrival_s: float  # engine clock at arrival (a pull lease counts from P's answer)
    first_block: int = 0  # the prompt block index block_ids[0] stands for (P's blocks alike)


def source_blocks(prompt_blocks: Sequence[int], first_block: int, count: int) -> list[int]:
    """The prefill side's blocks that fill a receive: its prompt blocks from `first_block`
    on, `count` of them. Pull (what D reads), push (what P writes) and the simulator pair
    blocks only through this: an offset wrong here puts one block's KV in another's place."""
    return list(prompt_blocks[first_block : first_block + count])


@dataclass(frozen=True, slots=True)
class KVSend:
    """Prefill side: a finished prefill whose KV a decode instance will take."""

    request_id: str
    block_ids: tuple[int, ...]  # ours, holding the prompt's KV
    first_token_id: int  # sampled here; the decode instance emits it first
    params: KVTransferParams  # the router's (push: transfer id and the decode engine named)


@dataclass(slots=True)
class KVConnectorMeta:
    """What the worker must start this step. Plain ids and the router's params only."""

    receives: list[KVReceive] = field(default_factory=list)
    sends: list[KVSend] = field(default_factory=list)
    # Requests that left a KV state early (abort, failure, recompute). For each, the worker
    # reports the id in `settled` once no transfer can touch its blocks (at once if none can).
    aborts: list[str] = field(default_factory=list)
    # Decode side: the router's params of requests that ended before their receive was set up
    # (aborted while waiting for blocks or a seat): no transfer will come for what the prefill
    # side holds, and the worker may tell it so. Nothing here holds blocks of ours.
    dropped: list[KVTransferParams] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.receives or self.sends or self.aborts or self.dropped)


class KVConnectorScheduler(abc.ABC):
    """Pure: the Scheduler's view of handoffs. Subclasses say what a finished prefill returns."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._meta = KVConnectorMeta()
        self._active: dict[str, tuple[int, ...]] = {}  # request id -> blocks a transfer may touch

    def get_num_new_matched_tokens(self, request: Request) -> int:
        """Prompt tokens whose KV arrives from remote (0 = compute locally). Does not mutate."""
        return request.num_prompt_tokens if request.needs_remote_kv else 0

    def on_blocks_allocated(
        self, request: Request, block_ids: list[int], num_external: int
    ) -> None:
        """The request is WAITING_FOR_REMOTE_KV with `block_ids` reserved: queue the receive."""
        assert request.kv_transfer_params is not None
        first = request.num_reused_blocks
        blocks = tuple(block_ids[first : self.num_prompt_blocks(request)])
        self._active[request.request_id] = blocks  # the reused ones are never written
        receive = KVReceive(
            request.request_id, blocks, request.kv_transfer_params, request.arrival_s, first
        )
        self._meta.receives.append(receive)

    def request_finished(self, request: Request) -> tuple[bool, KVTransferParams | None]:
        """A prefill finished. (keep_blocks, params): keep means WAITING_FOR_KV_SEND until
        the worker reports it in finished_sending; params go back as kv_transfer_params.
        Decode side, also called for a request that finished before its receive began."""
        params = request.kv_transfer_params
        if params is not None and params.do_remote_prefill and request.needs_remote_kv:
            self._meta.dropped.append(params)  # never received: aborted while it waited
            return False, None
        if params is None or not params.do_remote_decode or not self.accepts(params):
            return False, None
        if request.finish_status in _NOT_SENT:
            return False, None  # aborted or failed: nobody will take its KV
        blocks = tuple(request.block_ids[: self.num_prompt_blocks(request)])
        first = request.output_token_ids[0]
        self._active[request.request_id] = blocks
        self._meta.sends.append(KVSend(request.request_id, blocks, first, params))
        answer = self.finished_params(request, list(blocks), first)
        if request.output_logprobs and request.output_logprobs[0] is not None:
            # Relayed to the decode instance with first_token_id (pull: the router copies
            # these params into D's leg), so the client gets the first token's logprobs too.
            first_logprobs = request.output_logprobs[0].to_dict()
            answer = dataclasses.replace(answer, first_token_logprobs=first_logprobs)
        return True, answer

    def request_aborted(self, request: Request) -> bool:
        """The request leaves a KV state early. True if a transfer may still touch its blocks:
        the scheduler holds them in `draining` until the worker reports the id `settled`."""
        if request.request_id not in self._active:
            return False
        self._meta.aborts.append(request.request_id)
        return True

    def update_state(self, output: KVConnectorOutput) -> None:
        """What the worker reported this step: transfers that ended no longer hold blocks."""
        for request_id in output.finished_recving | output.finished_sending | output.settled:
            self._active.pop(request_id, None)

    def build_meta(self) -> KVConnectorMeta:
        """Called at the end of schedule(): this step's work for the worker, cleared."""
        meta, self._meta = self._meta, KVConnectorMeta()
        return meta

    def blocks_in_use(self) -> set[int]:
        """Blocks a transfer may touch. Invariant (Scheduler.check_integrity): never free."""
        return {b for blocks in self._active.values() for b in blocks}

    def num_prompt_blocks(self, request: Request) -> int:
        return -(-request.num_prompt_tokens // self.block_size)

    def accepts(self, params: KVTransferParams) -> bool:
        """Whether a do_remote_decode request can be handed off under this mode."""
        return True

    @abc.abstractmethod
    def finished_params(self, request: Request, blocks: list[int], first: int) -> KVTransferParams:
        """The kv_transfer_params a finished prefill returns to the router."""


class KVConnectorWorker(abc.ABC):
    """The engine loop's side: moves bytes, owns threads and the side channel."""

    @abc.abstractmethod
    def start_load(self, meta: KVConnectorMeta) -> None:
        """Engine loop, once per step, right after schedule(): start what `meta` asks."""

    @abc.abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Engine loop, once per step: what finished, failed or settled since the last call."""

    @abc.abstractmethod
    def has_pending(self) -> bool:
        """True while any transfer, lease or reservation is outstanding."""

    def needs_loop_poll(self) -> bool:
        """True while the engine loop must poll transfers itself (it then sleeps only briefly
        between empty steps); False when every result arrives by a wake-up."""
        return False

    def side_channel(self) -> dict[str, Any]:
        """POST path -> async handler(JSON body) -> JSON answer; the server mounts them."""
        return {}

    def info(self) -> dict[str, Any]:
        return {}

    def set_address(self, host: str, port: int) -> None:  # noqa: B027 - optional hook
        """The HTTP address peers reach this instance's side channel on."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop threads and release the transport."""
