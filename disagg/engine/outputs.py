"""The scheduler <-> runner contract: what to compute this step, and what came back.

Plain dataclasses of ints and lists; the runner turns them into tensors once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.protocol import SamplingParams

__all__ = ["KVConnectorOutput", "RunnerOutput", "ScheduledRequest", "SchedulerOutput"]


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


@dataclass(slots=True)
class KVConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)  # prefill side: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # decode side: KV landed
    failed: dict[str, str] = field(default_factory=dict)  # request id -> reason (transfer failed)
    first_token_ids: dict[str, int] = field(default_factory=dict)  # push: P's sampled token

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending or self.finished_recving or self.failed or self.first_token_ids
        )


@dataclass(slots=True)
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> new token
    kv: KVConnectorOutput = field(default_factory=KVConnectorOutput)
