"""The multi-turn workload (`--dataset multiturn`) on the virtual clock: `disagg bench`'s
conversations (bench/multiturn.py) as token ids.

Every conversation opens with the same system prompt (`prefix_len` ids), each turn adds a user
message (`input_len` ids), and the answer the simulated instances actually returned joins the
history before the next turn, which is sent the moment the answer is in. So a turn's prompt
holds its conversation so far, and what the prefix caches and the router's placement reuse of
it is the real scheduler's and policy's doing. Conversation i starts at the i-th arrival offset;
a turn that fails ends its conversation, as in the bench.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.bench.arrivals import arrival_offsets_s
from disagg.bench.metrics import RequestResult
from disagg.bench.workload import WorkloadConfig
from disagg.sim.events import EventLoop
from disagg.sim.router import ClientRequest, SimRouter
from disagg.sim.sim_config import SimConfig

__all__ = ["SimConversation", "make_sim_conversations", "submit_conversations"]

_USER_SEED_OFFSET = 7_919  # user turns from their own stream: the system prompt is shared


@dataclass(slots=True)
class SimConversation:
    index: int
    user_turns: list[list[int]]
    history: list[int]  # the system prompt, then each turn sent and the answer it got
    output_len: int
    num_sent: int = 0  # turns sent so far


def make_sim_conversations(cfg: WorkloadConfig) -> list[SimConversation]:
    """`cfg.num_prompts` conversations of `cfg.num_turns` turns, deterministic in the seed."""
    lo, hi = cfg.token_range
    system = np.random.default_rng(cfg.seed).integers(lo, hi, size=cfg.prefix_len).tolist()
    rng = np.random.default_rng(cfg.seed + _USER_SEED_OFFSET)
    return [
        SimConversation(
            index=c,
            user_turns=[
                rng.integers(lo, hi, size=cfg.input_len).tolist() for _ in range(cfg.num_turns)
            ],  # fmt: skip
            history=list(system),
            output_len=cfg.output_len,
        )
        for c in range(cfg.num_prompts)
    ]


def submit_conversations(config: SimConfig, router: SimRouter, loop: EventLoop) -> None:
    """Schedule every conversation's first turn; each later one follows its answer."""
    w = config.workload
    conversations = make_sim_conversations(w)
    offsets = arrival_offsets_s(len(conversations), config.request_rate, config.burstiness, w.seed)
    for conv, offset in zip(conversations, offsets, strict=True):
        loop.at(offset, lambda c=conv: _send_turn(c, router))


def _send_turn(conv: SimConversation, router: SimRouter) -> None:
    prompt = conv.history + conv.user_turns[conv.num_sent]
    conv.num_sent += 1

    def answered(request: ClientRequest) -> None:
        if request.result.success and conv.num_sent < len(conv.user_turns):
            assert request.output_ids is not None
            conv.history = prompt + request.output_ids
            _send_turn(conv, router)

    router.submit(
        ClientRequest(
            request_id=f"c{conv.index}-t{conv.num_sent}",
            prompt_token_ids=prompt,  # a fresh list: the next turn extends `history`, not it
            output_len=conv.output_len,
            result=RequestResult(input_len=len(prompt), turn=conv.num_sent),
            output_ids=[],
            on_done=answered,
        )
    )
