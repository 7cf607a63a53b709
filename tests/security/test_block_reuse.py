"""A block is reused only after every transfer that may touch it has settled.

Regression for the late-write race: the scheduler used to free a request's `draining` blocks in
the same step that reported its transfer's failure, while the connector still held the
reservation; a late write from the prefill side then landed in blocks already handed to
another request (served as HTTP 200 with wrong text). Pure scheduler + fake connector here;
tests/security/test_attacks.py reproduces it end to end.
"""

from __future__ import annotations

import pytest

from disagg.engine.outputs import KVConnectorOutput, KVFailure, RunnerOutput
from disagg.engine.request import RequestStatus
from tests import fakes


class _LateWriteConnector(fakes.FakeConnector):
    """Reports a handoff failed while its write may still land (a reservation that timed out
    while P still has it): every abort says "in flight", and nothing settles until told."""

    def __init__(self) -> None:
        super().__init__(delay=10**9)
        self.in_flight_on_abort = True
        self.out = KVConnectorOutput()

    def get_finished(self) -> KVConnectorOutput:
        out, self.out = self.out, KVConnectorOutput()
        return out

    def blocks_in_use(self) -> set[int]:
        return {b for rid in self.settling for b in self.block_ids.get(rid, [])}


def _step(sched, connector, out: KVConnectorOutput | None = None) -> None:
    if out is not None:
        connector.out = out
    fakes.run_step(sched, fakes.FakeRunner(), connector)
    sched.check_integrity()


@pytest.mark.parametrize("recompute", [False, True])
def test_failed_handoff_keeps_blocks_until_settled(recompute: bool) -> None:
    connector = _LateWriteConnector()
    sched = fakes.make_scheduler(num_blocks=8, block_size=4, connector=connector)
    victim = fakes.make_request(num_tokens=10, remote_prefill=True, first_token_id=3)
    sched.add_request(victim)
    _step(sched, connector)  # (1) D reserves 3 blocks for P's write
    reserved = set(connector.block_ids[victim.request_id])
    failure = KVFailure("no KV within 30s", recompute=recompute)
    _step(sched, connector, KVConnectorOutput(failed={victim.request_id: failure}))  # (2)
    assert victim.request_id in sched.draining, "blocks freed while a write may land"
    other = fakes.make_request(num_tokens=20)
    sched.add_request(other)  # (3) another request wants blocks now
    _step(sched, connector)
    assert not reserved & set(other.block_ids), "a block that P may still write was reused"
    connector.settling.clear()  # (4) the write settled (P confirmed): report it
    _step(sched, connector, KVConnectorOutput(settled={victim.request_id}))
    assert victim.request_id not in sched.draining
    fakes.drain(sched, fakes.FakeRunner(), connector)
    fakes.assert_no_leaks(sched)


def test_check_integrity_names_a_free_block_a_transfer_touches() -> None:
    connector = _LateWriteConnector()
    sched = fakes.make_scheduler(num_blocks=8, connector=connector)
    connector.settling["ghost"] = 1
    connector.block_ids["ghost"] = [5]  # a transfer into block 5, which nobody holds
    with pytest.raises(AssertionError, match=r"\[5\]"):
        sched.check_integrity()


def test_runner_failure_fails_that_request_only() -> None:
    """A request whose sampling fails (e.g. no valid distribution) ends in an error; the
    other requests of the same step go on, and every block comes back."""
    sched = fakes.make_scheduler()
    bad, good = fakes.make_request(num_tokens=6), fakes.make_request(num_tokens=6)
    sched.add_request(bad)
    sched.add_request(good)
    out = sched.schedule(0.0)
    runner_out = fakes.FakeRunner().execute(out)
    del runner_out.sampled_token_ids[bad.request_id]
    runner_out.failed[bad.request_id] = "sampling found no valid distribution"
    outputs = sched.update(out, runner_out, 0.0)
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert errors == {bad.request_id: "sampling found no valid distribution"}
    assert bad.status is RequestStatus.FINISHED_ERROR
    assert good.status is RequestStatus.RUNNING
    fakes.drain(sched, fakes.FakeRunner())
    fakes.assert_no_leaks(sched)


def test_step_with_every_request_failed_keeps_scheduler_sound() -> None:
    """Engine._execute turns a model step that raised into RunnerOutput.failed for all of its
    requests: the scheduler ends them and the next request runs normally."""
    sched = fakes.make_scheduler()
    first = fakes.make_request(num_tokens=9)
    sched.add_request(first)
    out = sched.schedule(0.0)
    sched.update(out, RunnerOutput(failed={first.request_id: "model step failed"}), 0.0)
    assert first.status is RequestStatus.FINISHED_ERROR
    second = fakes.make_request(num_tokens=9)
    sched.add_request(second)
    fakes.drain(sched, fakes.FakeRunner())
    assert second.status is RequestStatus.FINISHED_LENGTH
    fakes.assert_no_leaks(sched)
