"""Pull, decode side, as a state machine over a fake transport: READ posted, landed, failed,
timed out, aborted at each point; inline (the engine loop steps it) and background (its own
thread). Every path ends with the blocks either loaded or settled, never free while a READ
may still land."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from disagg.kv.pull_reader import Load, PullReader
from disagg.kv.transport import Op, TransferState
from tests.kv.fakes import FakeBase, ready_peer


def _load(request_id: str = "r", peer: Future[str] | None = None) -> Load:
    return Load(
        request_id=request_id,
        local_ids=[4, 5],
        remote_ids=[7, 8],
        remote_request_id=f"p-{request_id}",
        prefill_url="http://p",
        peer=peer or ready_peer(),
        allocated_s=time.monotonic(),
        read_by_s=None,
    )


def _inline() -> tuple[PullReader, FakeBase]:
    base = FakeBase()
    return PullReader(base, is_background=False, stopping=threading.Event()), base


def test_read_posted_then_landed_reports_received() -> None:
    reader, base = _inline()
    load = _load()
    reader.add([load])
    reader.step()  # (1) peer known: the READ goes out, P's blocks into ours
    (handle,) = base.transport.posted
    posted = base.transport.posted[handle]
    assert (posted.op, posted.local_ids, posted.remote_ids) == (Op.READ, [4, 5], [7, 8])
    assert reader.blocks_in_use() == {4, 5}
    reader.step()  # (2) still in flight
    assert not base.reports.finished_recving
    base.transport.finish(handle)
    reader.step()  # (3) landed
    assert base.reports.finished_recving == {"r"} and posted.is_released
    assert not reader.has_work() and not reader.blocks_in_use()
    assert load.stages["loop_blocked_s"] > 0  # inline: the loop paid for it


def test_waits_for_the_handshake_then_fails_if_it_failed() -> None:
    reader, base = _inline()
    peer: Future[str] = Future()
    reader.add([_load(peer=peer)])
    reader.step()
    assert not base.transport.posted and reader.has_work()
    peer.set_exception(ConnectionError("refused"))
    reader.step()
    assert "handshake" in base.reports.failed["r"].reason
    assert base.released == ["p-r"]  # no READ will come: P frees its blocks at once
    assert not reader.has_work()


def test_abort_with_the_read_in_flight_settles_only_when_it_lands() -> None:
    reader, base = _inline()
    load = _load()
    reader.add([load])
    reader.step()
    (handle,) = base.transport.posted
    assert reader.abort(load.request_id)  # a READ may still land: the blocks wait
    reader.step()
    assert not base.reports.settled and reader.blocks_in_use() == {4, 5}
    base.transport.finish(handle, TransferState.ERR)
    reader.step()
    assert base.reports.settled == {"r"} and not reader.blocks_in_use()
    assert not base.reports.finished_recving  # an aborted load is never "received"


def test_abort_before_posting_frees_at_once_and_releases_p() -> None:
    reader, base = _inline()
    load = _load(peer=Future())  # handshake still running
    reader.add([load])
    assert not reader.abort(load.request_id)
    assert base.released == ["p-r"] and not reader.has_work()


def test_timeout_fails_the_request_but_keeps_the_blocks_until_settled() -> None:
    reader, base = _inline()
    base.kv_config.transfer_timeout_s = 0.0
    load = _load()
    reader.add([load])
    reader.step()
    (handle,) = base.transport.posted
    time.sleep(0.01)
    reader.step()
    assert "timed out" in base.reports.failed["r"].reason
    assert base.released == []  # the READ may still be copying P's blocks
    assert reader.abort(load.request_id)  # the scheduler fails it: the blocks go to draining
    base.transport.finish(handle)
    reader.step()
    assert base.reports.settled == {"r"} and base.released == ["p-r"]


def test_post_failure_fails_and_releases() -> None:
    reader, base = _inline()
    base.transport.fail_posts = True
    reader.add([_load()])
    reader.step()
    assert "failed to start" in base.reports.failed["r"].reason and base.released == ["p-r"]


def test_background_reader_needs_no_engine_loop() -> None:
    """The reader's own thread posts and polls: results arrive with no step() from the loop,
    and the loop's share of the handoff stays unmeasured (zero)."""
    base, stopping = FakeBase(), threading.Event()
    reader = PullReader(base, is_background=True, stopping=stopping)
    reader.start()
    try:
        load = _load()
        reader.add([load])
        _wait(lambda: base.transport.posted)
        base.transport.finish(next(iter(base.transport.posted)))
        _wait(lambda: base.reports.finished_recving == {"r"})
        assert "loop_blocked_s" not in load.stages
    finally:
        stopping.set()
        reader.close()


def _wait(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
