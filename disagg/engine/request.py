"""A request as the scheduler sees it: token ids, progress, blocks and status. Pure Python.

The scheduler owns every field; the KV connector only reads ids and fills `breakdown` timings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from disagg.protocol import (
    FinishReason,
    KVTransferParams,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
    TTFTBreakdown,
)

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued for (re)computation
    WAITING_FOR_REMOTE_KV = 1  # blocks allocated, KV arriving from a prefill instance
    RUNNING = 2  # prefilling in chunks or decoding
    PREEMPTED = 3  # blocks taken back; will recompute from its tokens
    WAITING_FOR_KV_SEND = 4  # done computing; blocks held until a decode instance has them
    # Finished states are last so `is_finished` is one comparison.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float = 0.0  # engine clock at add time
    kv_transfer_params: KVTransferParams | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Parallel to output_token_ids when sampling.logprobs is set (None where unknown), else
    # empty: logprobs are kept only for requests that asked.
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in `block_ids`
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache or a remote prefill
    block_ids: list[int] = field(default_factory=list)  # covers num_computed_tokens (and more)
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the full blocks so far
    # The chain digests of the token sequence's full blocks as far as any lookup has needed them:
    # tokens are only appended, so a computed prefix of the chain never changes (computed once,
    # not again when the blocks are published).
    chain_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None  # set with FINISHED_ERROR
    finish_status: RequestStatus | None = None  # how it finished (status may then be KV_SEND)
    kv_result: KVTransferParams | None = None  # kv_transfer_params returned to the caller
    needs_remote_kv: bool = False  # decode side: prompt KV still to come from a prefill instance
    # Decode side: leading prompt blocks taken from this pool's own prefix cache; the remote
    # KV fills only the blocks after them.
    num_reused_blocks: int = 0
    num_emitted_tokens: int = 0  # output tokens already returned to the caller
    queued_uncached_tokens: int = 0  # while waiting: tokens the cache was not expected to cover
    first_scheduled_s: float | None = None
    breakdown: TTFTBreakdown = field(default_factory=TTFTBreakdown)

    def __post_init__(self) -> None:
        params = self.kv_transfer_params
        self.needs_remote_kv = bool(params and params.do_remote_prefill)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_remote_decode(self) -> bool:
        """Prefill side: keep the KV for a decode instance after the first token."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.do_remote_decode)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def stop_status(
        self, token: int, max_model_len: int, eos_token_ids: frozenset[int]
    ) -> RequestStatus | None:
        """The finished state `token` (just appended) puts this request in, or None."""
        sampling = self.sampling
        if self.num_output_tokens >= sampling.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.num_output_tokens < sampling.min_tokens:
            return None
        if token in sampling.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not sampling.ignore_eos and token in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None

    def take_output(self) -> RequestOutput:
        """What the caller has not seen yet (tokens since the last output), as one output;
        marks those tokens emitted."""
        new_tokens = self.output_token_ids[self.num_emitted_tokens :]
        new_logprobs = None
        if self.sampling.logprobs is not None:
            new_logprobs = self.output_logprobs[self.num_emitted_tokens :]
        self.num_emitted_tokens = self.num_output_tokens
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_tokens,
            finish_reason=self.finish_status.finish_reason if self.finish_status else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=self.kv_result,
            error=self.error,
            breakdown=self.breakdown,
            new_logprobs=new_logprobs,
        )
