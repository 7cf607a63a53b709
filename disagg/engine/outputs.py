"""The scheduler <-> runner contract: what to compute this step, and what came back.

Plain dataclasses of ints and lists; the runner turns them into tensors once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.protocol import SamplingParams, TokenLogprobs

__all__ = [
    "KVConnectorOutput",
    "KVFailure",
    "RunnerOutput",
    "ScheduledRequest",
    "SchedulerOutput",
]


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or 1 for decode)
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_ids: list[int]  # the whole block table; covers start_pos + len(token_ids)
    do_sample: bool  # this chunk reaches the end of the sequence: sample the next token
    sampling: SamplingParams
    output_index: int  # index of the token to sample among the outputs (seeds per position)


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)  # prefills first, decodes last
    num_scheduled_tokens: int = 0  # sum of len(token_ids); <= max_num_batched_tokens
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    kv_meta: object = None  # the connector's per-step metadata (loads to start); None = none

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class KVFailure:
    """Why a request's KV handoff failed, and what the deployment's policy says to do."""

    reason: str  # for the client's error message and the log
    recompute: bool = False  # True: prefill locally from the prompt instead of failing


@dataclass(slots=True)
class KVConnectorOutput:
    """What the connector learned since the last step. A request id may appear in `failed` and
    later in `settled`: failing a request ends it for the client, settling frees its blocks."""

    finished_sending: set[str] = field(default_factory=set)  # prefill side: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # decode side: KV landed
    failed: dict[str, KVFailure] = field(default_factory=dict)  # request id -> why
    # Requests whose blocks the scheduler holds in `draining` because a transfer might still
    # touch them: it has now ended (or was proven never to start); the blocks may be reused.
    settled: set[str] = field(default_factory=set)
    first_token_ids: dict[str, int] = field(default_factory=dict)  # push: P's sampled token
    # TTFTBreakdown fields the worker measured, by request (handoff_setup_s, transfer_s,
    # loop_blocked_s, num_descriptors, num_bytes): the scheduler copies them into the request.
    stages: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed
            or self.settled
            or self.first_token_ids
            or self.stages
        )


@dataclass(slots=True)
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> new token
    # request id -> logprobs of its new token; only requests whose sampling.logprobs is set
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Requests the runner could not serve (e.g. sampling produced no valid distribution): the
    # scheduler fails each one alone; the rest of the batch is unaffected.
    failed: dict[str, str] = field(default_factory=dict)  # request id -> reason
    kv: KVConnectorOutput = field(default_factory=KVConnectorOutput)
