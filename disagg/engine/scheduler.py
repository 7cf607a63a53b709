"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Pure Python: requests, block ids and token counts in; a SchedulerOutput out; RunnerOutput back
in `update()`. Time is passed in by the caller, never read here. Requests whose KV is in
flight are states (WAITING_FOR_REMOTE_KV, WAITING_FOR_KV_SEND), never sleeps or flags.
"""

from __future__ import annotations

from disagg.config import SchedulerConfig
from disagg.engine.block_pool import BlockPool
from disagg.engine.kv_cache_manager import KVCacheManager
from disagg.engine.kv_connector import KVConnectorMeta, KVConnectorScheduler
from disagg.engine.outputs import (
    KVConnectorOutput,
    KVFailure,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from disagg.engine.request import Request, RequestStatus
from disagg.engine.waiting_queue import WaitingQueue
from disagg.protocol import KVTransferParams, RequestOutput, TokenLogprobs

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_pool: BlockPool,
        block_size: int,
        *,
        eos_token_ids: tuple[int, ...] = (),
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.block_pool = block_pool
        self.block_size = block_size
        self.kv = KVCacheManager(block_pool, block_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.connector = connector
        self.requests: dict[str, Request] = {}  # every request not yet released
        self.waiting = WaitingQueue(self.kv.num_cached_prefix_tokens)
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.sending: dict[str, Request] = {}  # WAITING_FOR_KV_SEND
        self.draining: dict[str, list[int]] = {}  # request id -> blocks a transfer may still hit
        self._finished_ids: set[str] = set()  # for the runner, next step
        self._pending_outputs: list[RequestOutput] = []  # produced outside update()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ intake

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, now: float) -> bool:
        """Abort a request wherever it is. Returns False if unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED, now)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_kv_pending(self) -> bool:
        return bool(self.waiting_for_kv or self.sending or self.draining)

    # ------------------------------------------------------------------ schedule

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(out, budget, now)
        if not preempted:
            self._schedule_waiting(out, budget, now)
        # Decodes last keeps prefill chunks contiguous at the front of the batch.
        out.requests.sort(key=lambda s: len(s.token_ids) == 1)
        out.num_scheduled_tokens = sum(len(s.token_ids) for s in out.requests)
        if self.connector is not None:
            out.kv_meta = self.connector.build_meta()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> tuple[int, bool]:
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.can_grow(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self.kv.grow(request, num_new)
            out.requests.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        return budget, preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.needs_remote_kv and request.num_computed_tokens == 0:
                if not self._reserve_for_remote_kv(request, now):
                    return
                continue
            if not request.block_ids:
                self.kv.match_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.can_grow(request, num_new):
                self.kv.reset(request)
                return
            self.waiting.popleft()
            self.kv.grow(request, num_new)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_s is None:
                request.first_scheduled_s = now
                request.breakdown.queue_s = now - request.arrival_s
            self.running.append(request)
            out.requests.append(self._scheduled(request, num_new))
            budget -= num_new

    def _reserve_for_remote_kv(self, request: Request, now: float) -> bool:
        """Decode side: allocate blocks for the prompt (+ the first token) and hand them to
        the connector. Returns False when the pool cannot hold them yet."""
        assert self.connector is not None, "remote prefill requested without a KV connector"
        num_external = self.connector.get_num_new_matched_tokens(request)
        if not self.kv.allocate_for_prompt(request):
            return False
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.first_scheduled_s = now
        request.breakdown.decode_wait_s = now - request.arrival_s  # D's own queue
        self.waiting_for_kv[request.request_id] = request
        self.connector.on_blocks_allocated(request, request.block_ids, num_external)
        return True

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + num_new),
            start_pos=start,
            block_ids=request.block_ids,
            do_sample=start + num_new == request.num_tokens,
            sampling=request.sampling,
            output_index=request.num_output_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.reset(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ update

    def update(
        self, sched: SchedulerOutput, runner: RunnerOutput, now: float
    ) -> list[RequestOutput]:
        outputs = self._pending_outputs
        self._pending_outputs = []
        for scheduled in sched.requests:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            if scheduled.request_id in runner.failed:
                request.error = runner.failed[scheduled.request_id]
                self._finish(request, RequestStatus.FINISHED_ERROR, now)
                continue
            request.num_computed_tokens += len(scheduled.token_ids)
            self.kv.cache_full_blocks(request)
            token = runner.sampled_token_ids.get(scheduled.request_id)
            if token is None:
                continue
            self._append_token(request, token, now, runner.logprobs.get(scheduled.request_id))
            outputs.append(request.take_output())
        self._apply_kv(runner.kv, now)
        outputs.extend(self._pending_outputs)
        self._pending_outputs = []
        return outputs

    def _append_token(
        self, request: Request, token: int, now: float, logprobs: TokenLogprobs | None = None
    ) -> None:
        params = request.kv_transfer_params
        if request.num_output_tokens == 0 and not (params and params.do_remote_prefill):
            request.breakdown.prefill_s = now - (request.first_scheduled_s or now)
            computed = request.num_prompt_tokens - request.num_cached_tokens
            request.breakdown.num_prefilled_tokens = computed
        request.output_token_ids.append(token)
        if request.sampling.logprobs is not None:
            request.output_logprobs.append(logprobs)
        status = request.stop_status(token, self.config.max_model_len, self.eos_token_ids)
        if status is not None:
            self._finish(request, status, now, emit=False)

    def _apply_kv(self, kv: KVConnectorOutput, now: float) -> None:
        if self.connector is not None:
            self.connector.update_state(kv)
        for request_id, stages in kv.stages.items():
            request = self.requests.get(request_id)
            if request is not None:
                for name, value in stages.items():
                    setattr(request.breakdown, name, value)
        for request_id in kv.finished_recving:
            self._on_kv_received(request_id, kv.first_token_ids.get(request_id), now)
        for request_id, failure in kv.failed.items():
            self._on_kv_failed(request_id, failure, now)
        for request_id in kv.finished_sending:
            self._on_kv_sent(request_id)
        # After `failed`: a failure may put blocks in `draining`, and only a settle frees them.
        for request_id in kv.settled:
            self._settle_draining(request_id)

    def _on_kv_received(self, request_id: str, first_token: int | None, now: float) -> None:
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return
        params = request.kv_transfer_params
        request.needs_remote_kv = False
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = request.num_prompt_tokens
        request.breakdown.num_reused_tokens = request.num_reused_blocks * self.block_size
        self.kv.cache_full_blocks(request)  # from the first block that was not reused
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if first_token is None and params is not None:
            first_token = params.first_token_id
        if first_token is not None:
            # P sampled the first token with the same parameters; carry it instead of
            # recomputing the last prompt token here (one step less on the TTFT path).
            request.breakdown.first_step_s = 0.0
            self._append_token(request, first_token, now, _relayed_logprobs(params))
            self._pending_outputs.append(request.take_output())
        else:
            request.num_computed_tokens -= 1  # recompute the last prompt token to sample

    def _on_kv_failed(self, request_id: str, failure: KVFailure, now: float) -> None:
        """A handoff failed. A transfer may still be in flight: the blocks leave through
        _drop_kv_blocks, which keeps them in `draining` until the connector settles it."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status is RequestStatus.WAITING_FOR_KV_SEND:
            del self.sending[request_id]
            self._drop_kv_blocks(request)
            self._release(request)  # the caller already has its answer
            return
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            return
        if failure.recompute:
            # Policy `recompute`: prefill locally from the prompt, as if never disaggregated.
            del self.waiting_for_kv[request_id]
            self._drop_kv_blocks(request)
            request.block_hashes, request.num_reused_blocks = [], 0  # matched afresh
            request.needs_remote_kv = False
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            return
        request.error = failure.reason
        self._finish(request, RequestStatus.FINISHED_ERROR, now)

    def _on_kv_sent(self, request_id: str) -> None:
        request = self.sending.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
            self._release(request)

    def _settle_draining(self, request_id: str) -> None:
        block_ids = self.draining.pop(request_id, None)
        if block_ids is not None:
            self.block_pool.free(block_ids)

    def _drop_kv_blocks(self, request: Request) -> None:
        """The one way blocks leave a KV state early (abort, failure, recompute): freed now only
        if the connector says no transfer can touch them any more; otherwise they wait in
        `draining` until the connector reports the id in `settled`. Reusing them sooner is how
        a late write lands in another request's KV (check_integrity checks this)."""
        assert self.connector is not None
        if self.connector.request_aborted(request):
            self.draining[request.request_id] = request.block_ids
            request.block_ids = []
        else:
            self.kv.free(request)

    # ------------------------------------------------------------------ finish

    def _finish(
        self, request: Request, status: RequestStatus, now: float, emit: bool = True
    ) -> None:
        """Move a request to a finished state and decide what happens to its blocks."""
        previous = request.status
        request.status = status
        request.finish_status = status
        self._unlink(request, previous)
        if previous in (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.WAITING_FOR_KV_SEND):
            self._drop_kv_blocks(request)
            self._release(request)
        else:
            self._finish_computed(request)
        if emit:
            self._pending_outputs.append(request.take_output())

    def _finish_computed(self, request: Request) -> None:
        params = None
        keep = False
        if self.connector is not None and request.status is not RequestStatus.FINISHED_ERROR:
            keep, params = self.connector.request_finished(request)
        request.kv_result = params
        if keep:
            self.sending[request.request_id] = request
            request.status = RequestStatus.WAITING_FOR_KV_SEND
        else:
            self.kv.free(request)
            self._release(request)

    def _unlink(self, request: Request, previous: RequestStatus) -> None:
        if previous is RequestStatus.RUNNING:
            self.running.remove(request)
        elif previous in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif previous is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request.request_id]
        elif previous is RequestStatus.WAITING_FOR_KV_SEND:
            del self.sending[request.request_id]

    def _release(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)

    def take_kv_meta(self) -> KVConnectorMeta | None:
        """The connector's work raised since schedule() (sends and aborts from update() or
        from an abort between steps), for the worker."""
        return self.connector.build_meta() if self.connector is not None else None

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside update() (aborts between steps), cleared."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def check_integrity(self) -> None:
        """Raise if the pool's books disagree, or if a block some transfer may still touch is
        free (it could be handed to another request while bytes land in it)."""
        self.block_pool.check_integrity()
        self.waiting.check_integrity()
        if self.connector is None:
            return
        exposed = sorted(
            b for b in self.connector.blocks_in_use() if self.block_pool.ref_count(b) == 0
        )
        if exposed:
            raise AssertionError(f"blocks free while a transfer may touch them: {exposed[:16]}")

    # ------------------------------------------------------------------ observability

    def load(self) -> dict[str, int]:
        # Waiting requests hold no computed tokens between steps (a head that could not start
        # is reset), so the queue's token sum is what is left to prefill there.
        # A running request with more than one token left is mid-prefill (decodes have one).
        prefilling = sum(
            left for r in self.running if (left := r.num_tokens - r.num_computed_tokens) > 1
        )
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + len(self.waiting_for_kv),
            "num_free_blocks": self.block_pool.num_free_blocks,
            "num_total_blocks": self.block_pool.num_blocks,
            "num_queued_prefill_tokens": self.waiting.num_tokens + prefilling,
            # the same less what the prefix cache is expected to cover (for kv_aware)
            "num_queued_uncached_tokens": self.waiting.num_uncached_tokens + prefilling,
        }


def _relayed_logprobs(params: KVTransferParams | None) -> TokenLogprobs | None:
    """The first token's logprobs as the prefill instance sent them (validated on arrival);
    None when it sent none (push relays only the token id)."""
    if params is None or params.first_token_logprobs is None:
        return None
    return TokenLogprobs.from_dict(params.first_token_logprobs)
