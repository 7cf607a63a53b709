"""The handoff's cleanup table: what ending it at each stage undoes, and the stages it may
move through. Pure: a recording stand-in for Legs, no network."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from disagg.router.breaker import CircuitBreaker
from disagg.router.handoff import Handoff, Stage
from disagg.router.instances import Instance

P = Instance("http://p", "prefill", CircuitBreaker(max_failures=0, cooldown_s=1.0))
D = Instance("http://d", "decode", CircuitBreaker(max_failures=0, cooldown_s=1.0))


class _Recorder:
    """Stands in for Legs: records each abort, release and fenced abort."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def abort(self, inst: Instance, request_id: str) -> None:
        self.calls.append(("abort", inst.role, request_id))

    def release(self, inst: Instance, lease_id: str) -> None:
        self.calls.append(("release", inst.role, lease_id))

    def fence_then_release(
        self, decode: Instance, request_id: str, prefill: Instance, lease_id: str
    ) -> None:
        self.calls.append(("fence_then_release", decode.role, request_id, prefill.role, lease_id))


PULL_ENDS = [
    (Stage.PREFILLING, [("abort", "prefill", "r1"), ("release", "prefill", "lease-1")]),
    (Stage.REFUSED, []),
    (Stage.LEASED, [("abort", "prefill", "r1"), ("release", "prefill", "lease-1")]),
    (
        Stage.SENT,
        [("abort", "prefill", "r1"), ("fence_then_release", "decode", "r1", "prefill", "lease-1")],
    ),
    (Stage.DONE, []),
]


@pytest.mark.parametrize(("stage", "expected"), PULL_ENDS, ids=[s.name for s, _ in PULL_ENDS])
def test_pull_handoff_ends_by_its_stage(stage: Stage, expected: list[tuple[Any, ...]]) -> None:
    legs = _Recorder()
    handoff = Handoff("r1", P, stage, D, lease_id="lease-1")
    handoff.end(legs)  # type: ignore[arg-type]
    assert legs.calls == expected


@pytest.mark.parametrize(
    ("stage", "expected_aborts", "expected_cut"),
    [
        (Stage.PREFILL_FAILED, [("abort", "decode", "r1")], {"decode"}),
        (Stage.DECODE_FAILED, [("abort", "prefill", "r1")], {"prefill", "decode"}),
        (Stage.DONE, [], set()),
    ],
)
def test_push_pair_ends_by_its_stage(
    stage: Stage, expected_aborts: list[tuple[Any, ...]], expected_cut: set[str]
) -> None:
    async def main() -> None:
        legs = _Recorder()
        in_flight: dict[Any, asyncio.Task[Any]] = {
            "prefill": asyncio.create_task(asyncio.sleep(10)),
            "decode": asyncio.create_task(asyncio.sleep(10)),
        }
        handoff = Handoff("r1", P, Stage.PAIRED, D, in_flight=in_flight)
        handoff.advance(stage)
        handoff.end(legs)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert legs.calls == expected_aborts
        assert {pool for pool, task in in_flight.items() if task.cancelled()} == expected_cut
        for task in in_flight.values():
            task.cancel()

    asyncio.run(main())


def test_a_pull_handoff_goes_back_to_leased_when_decode_never_took_it() -> None:
    handoff = Handoff("r1", P, Stage.PREFILLING, lease_id="r1")
    for stage in (Stage.LEASED, Stage.SENT, Stage.LEASED, Stage.SENT, Stage.DONE):
        handoff.advance(stage)
    assert handoff.stage is Stage.DONE


@pytest.mark.parametrize(
    ("start", "stage"),
    [(Stage.PREFILLING, Stage.SENT), (Stage.DONE, Stage.LEASED), (Stage.PAIRED, Stage.SENT)],
)
def test_a_stage_out_of_order_is_a_bug(start: Stage, stage: Stage) -> None:
    with pytest.raises(AssertionError, match=f"{start.name} -> {stage.name}"):
        Handoff("r1", P, start).advance(stage)
