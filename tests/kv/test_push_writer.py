"""Push, prefill side, as a state machine over a fake transport: the kv-push-writer thread pairs
a decode instance's registration with the finished prefill in either order, writes, and frees
P's blocks when the write settles; refusals and aborts at each point."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from disagg.engine.kv_connector import KVSend
from disagg.kv.handshake import decode_message
from disagg.kv.push_writer import PushWriter
from disagg.kv.transport import Op, TransferState
from disagg.protocol import KVTransferParams
from tests.kv.fakes import FakeBase


@pytest.fixture
def writer() -> Iterator[tuple[PushWriter, FakeBase]]:
    base, stopping, control = FakeBase(), threading.Event(), ThreadPoolExecutor(1)
    push_writer = PushWriter(base, control, stopping)  # type: ignore[arg-type]
    push_writer.start()
    yield push_writer, base
    stopping.set()
    control.shutdown(wait=True)


@pytest.mark.parametrize("registration_first", [True, False])
def test_write_in_either_order_then_free_on_settle(writer, registration_first: bool) -> None:
    push_writer, base = writer
    register = lambda: push_writer.register("t1", "decode-1", [10, 11], 30.0)  # noqa: E731
    ready = lambda: push_writer.prefill_done(_send("t1", "r1", [1, 2], 42, "decode-1"))  # noqa: E731
    for step in (register, ready) if registration_first else (ready, register):
        step()
    handle = _wait(lambda: next(iter(base.transport.posted), None))
    posted = base.transport.posted[handle]
    assert (posted.op, posted.peer, posted.local_ids, posted.remote_ids) == (
        Op.WRITE, "decode-1", [1, 2], [10, 11],
    )  # fmt: skip
    assert decode_message(posted.notif)["first_token_id"] == 42  # D emits P's token
    assert push_writer.blocks_in_use() == {1, 2} and not base.reports.finished_sending
    base.transport.finish(handle)
    _wait(lambda: base.reports.finished_sending == {"r1"})
    assert not push_writer.has_pending() and not push_writer.blocks_in_use()


def test_registration_from_another_decode_instance_is_refused(writer) -> None:
    """Only the decode instance the router named may receive the KV (stat +1, no write)."""
    push_writer, base = writer
    push_writer.prefill_done(_send("t1", "r1", [1, 2], 42, "decode-1"))
    push_writer.register("t1", "impostor", [10, 11], 30.0)
    _wait(lambda: base.stats["registrations_refused"] == 1)
    assert not base.transport.posted
    push_writer.register("t1", "decode-1", [20, 21], 30.0)  # the right one still works
    handle = _wait(lambda: next(iter(base.transport.posted), None))
    assert base.transport.posted[handle].remote_ids == [20, 21]


def test_a_failed_write_tells_decode_and_frees(writer) -> None:
    push_writer, base = writer
    push_writer.register("t1", "decode-1", [10, 11], 30.0)
    push_writer.prefill_done(_send("t1", "r1", [1, 2], 42, "decode-1"))
    handle = _wait(lambda: next(iter(base.transport.posted), None))
    base.transport.finish(handle, TransferState.ERR)
    _wait(lambda: base.reports.finished_sending == {"r1"})
    (peer, raw), *_ = base.transport.notifs
    assert peer == "decode-1" and decode_message(raw)["kind"] == "write_failed"


def test_abort_mid_write_settles_instead_of_sending(writer) -> None:
    """P's request is aborted while its WRITE reads the blocks: they are reported `settled`
    (the scheduler holds them in draining) only once the write ends."""
    push_writer, base = writer
    push_writer.register("t1", "decode-1", [10, 11], 30.0)
    push_writer.prefill_done(_send("t1", "r1", [1, 2], 42, "decode-1"))
    handle = _wait(lambda: next(iter(base.transport.posted), None))
    assert push_writer.abort("r1") is True
    time.sleep(0.02)
    assert not base.reports.settled
    base.transport.finish(handle)
    _wait(lambda: base.reports.settled == {"r1"})
    assert not base.reports.finished_sending


def test_abort_before_the_registration_frees_at_once_and_tells_decode(writer) -> None:
    push_writer, base = writer
    push_writer.register("t1", "decode-1", [10, 11], 30.0)
    push_writer.abort("unknown")  # harmless
    push_writer.prefill_done(_send("t2", "r2", [1], 5, None))
    assert push_writer.abort("r2") is False  # nothing in flight: the scheduler frees now
    assert not push_writer.has_pending()


def test_cancel_answers_only_once_the_write_settled(writer) -> None:
    push_writer, base = writer
    push_writer.register("t1", "decode-1", [10, 11], 30.0)
    push_writer.prefill_done(_send("t1", "r1", [1, 2], 42, "decode-1"))
    handle = _wait(lambda: next(iter(base.transport.posted), None))

    async def cancel_then_finish() -> str:
        pending = asyncio.ensure_future(push_writer.cancel("t1", 5.0))
        await asyncio.sleep(0.05)
        assert not pending.done()  # the write still reads our blocks into D's
        base.transport.finish(handle)
        return await pending

    assert asyncio.run(cancel_then_finish()) == "done"
    assert asyncio.run(push_writer.cancel("t-never", 1.0)) == "dropped"


def _wait(get: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := get()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    return value


def _send(
    tid: str, request_id: str, block_ids: list[int], first: int, decode: str | None
) -> KVSend:
    """A finished prefill as the push scheduler hands it over, for `decode` only."""
    params = KVTransferParams(do_remote_decode=True, transfer_id=tid, remote_engine_id=decode)
    return KVSend(request_id, tuple(block_ids), first, params)
