"""A request's KV handoff between a prefill and a decode instance: its stages, and what ending it
at each stage undoes. This is where a handoff's cleanup is decided: `CLEANUP`, one row per
stage, read only by `Handoff.end`.

Pull:  PREFILLING -> LEASED <-> SENT -> DONE          (REFUSED: P never took its leg)
Push:  PAIRED -> DONE | PREFILL_FAILED | DECODE_FAILED

The flows (pull_flow.py, push_flow.py) move a handoff from stage to stage and end it once,
whatever ends the request. Must not send a leg (legs.py) nor decide when a leg is resent.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disagg.router.instances import Instance, PoolName

if TYPE_CHECKING:
    from disagg.router.legs import Legs

__all__ = ["CLEANUP", "Cleanup", "Handoff", "Release", "Stage"]


class Stage(enum.Enum):
    """How far a handoff got; its row in CLEANUP says what ending it there undoes."""

    # pull: P's leg first, then D's to a decode instance picked once P has answered
    PREFILLING = enum.auto()  # P may have taken its leg: its answer is not in hand
    REFUSED = enum.auto()  # P never took its leg (it never reached P, or P answered 4xx)
    LEASED = enum.auto()  # P answered and leases the blocks; no decode instance has the leg
    SENT = enum.auto()  # D's leg may have reached D, which may be reading P's blocks
    # push: both legs at once, P writing into the blocks D reserved
    PAIRED = enum.auto()  # both legs in flight
    PREFILL_FAILED = enum.auto()  # P's leg failed: D's must not wait for a write
    DECODE_FAILED = enum.auto()  # D failed, the client left, or the handler was cancelled
    DONE = enum.auto()  # the client has its answer: each instance frees its own blocks


class Release(enum.Enum):
    """When P's lease on the prompt's blocks is released (pull): reads are one-sided, so an
    abort alone keeps it until it expires."""

    NONE = enum.auto()  # nothing leased, or whoever reads it frees it
    NOW = enum.auto()  # no decode instance can read it
    AFTER_FENCE = enum.auto()  # D is aborted with a fence; released once D says it never took
    # the request (a leg cut mid-send, or a handler cancelled before submitting, tells P nothing)


@dataclass(frozen=True, slots=True)
class Cleanup:
    """What ending a handoff undoes, in this order."""

    # Legs whose task is cancelled (before D's headers, dropping the connection aborts it on D).
    cut: tuple[PoolName, ...] = ()
    abort: tuple[PoolName, ...] = ()  # instances sent POST /v1/abort for the request
    release: Release = Release.NONE  # P's lease


# One row per stage, read only by Handoff.end.
CLEANUP: dict[Stage, Cleanup] = {
    # P may have finished and leased blocks under the id we sent it (P resolves it to its own).
    Stage.PREFILLING: Cleanup(abort=("prefill",), release=Release.NOW),
    Stage.REFUSED: Cleanup(),
    Stage.LEASED: Cleanup(abort=("prefill",), release=Release.NOW),
    # D may be reading: D's read_done, D's own release or the lease's end frees the blocks.
    Stage.SENT: Cleanup(abort=("prefill",), release=Release.AFTER_FENCE),
    Stage.PAIRED: Cleanup(),  # only ever ended from one of the three stages after it
    Stage.PREFILL_FAILED: Cleanup(cut=("decode",), abort=("decode",)),
    Stage.DECODE_FAILED: Cleanup(cut=("prefill", "decode"), abort=("prefill",)),
    Stage.DONE: Cleanup(),
}

# The stages a handoff may move to from each one.
_NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.PREFILLING: frozenset({Stage.REFUSED, Stage.LEASED}),
    Stage.REFUSED: frozenset(),
    Stage.LEASED: frozenset({Stage.SENT}),
    # Back to LEASED when D's leg never reached D or D refused it (4xx): nobody reads the lease.
    Stage.SENT: frozenset({Stage.LEASED, Stage.DONE}),
    Stage.PAIRED: frozenset({Stage.PREFILL_FAILED, Stage.DECODE_FAILED, Stage.DONE}),
    Stage.PREFILL_FAILED: frozenset(),
    Stage.DECODE_FAILED: frozenset(),
    Stage.DONE: frozenset(),
}


@dataclass(slots=True)
class Handoff:
    """One request's handoff: the instances it involves and how far it got. `end()` is the only
    place its legs are cut or aborted and P's lease released."""

    request_id: str  # the X-Request-Id both legs carry; aborts name it
    prefill: Instance
    stage: Stage
    decode: Instance | None = None  # pull: None until D is picked, after P's answer
    lease_id: str | None = None  # pull: P's name for the lease, what /kv/release takes
    in_flight: dict[PoolName, asyncio.Task[Any]] = field(default_factory=dict)  # push: each leg

    def advance(self, stage: Stage) -> None:
        """Move to `stage`, one of the stages allowed after the current one."""
        assert stage in _NEXT[self.stage], (
            f"request {self.request_id}: handoff {self.stage.name} -> {stage.name}"
        )
        self.stage = stage

    def end(self, legs: Legs) -> None:
        """Undo what the handoff holds at its stage (its CLEANUP row); called once, when the
        request is over, whatever ended it."""
        row = CLEANUP[self.stage]
        for pool in row.cut:
            self.in_flight[pool].cancel()
        for pool in row.abort:
            legs.abort(self._instance(pool), self.request_id)
        if row.release is Release.NOW:
            legs.release(self.prefill, self._lease_id())
        elif row.release is Release.AFTER_FENCE:
            decode = self._instance("decode")
            legs.fence_then_release(decode, self.request_id, self.prefill, self._lease_id())

    def _instance(self, pool: PoolName) -> Instance:
        inst = self.prefill if pool == "prefill" else self.decode
        assert inst is not None, f"request {self.request_id}: no {pool} instance at {self.stage}"
        return inst

    def _lease_id(self) -> str:
        assert self.lease_id is not None, f"request {self.request_id}: no lease at {self.stage}"
        return self.lease_id
