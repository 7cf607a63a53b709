"""The prefix cache as events: what the block pool publishes and evicts, numbered, kept
bounded, and answered as the reports since a reader's last seq or as a snapshot."""

from __future__ import annotations

import pytest

from disagg.engine.block_pool import BlockPool, hash_blocks
from disagg.engine.kv_events import KVEventLog, wire_digest


def _digests(n: int, salt: int = 0) -> list[bytes]:
    return hash_blocks(None, [salt * 1000 + i for i in range(4 * n)], 4)


def test_a_reader_gets_the_reports_after_its_seq() -> None:
    log = KVEventLog()
    a, b = _digests(2), _digests(1, salt=1)
    log.stored(a)
    log.stored(b)
    log.removed(a[:1])
    first = log.since("", 0)  # first contact: a snapshot of what is held
    assert sorted(first["snapshot"]) == sorted(wire_digest(h) for h in [a[1], *b])
    assert first["seq"] == 3 and first["epoch"] == log.epoch
    after = log.since(log.epoch, 1)
    assert [(e["seq"], e["kind"]) for e in after["events"]] == [(2, "stored"), (3, "removed")]
    assert after["events"][1]["digests"] == [wire_digest(a[0])]
    assert log.since(log.epoch, 3) == {"epoch": log.epoch, "seq": 3, "events": []}


@pytest.mark.parametrize("reader", ["behind", "other_epoch", "ahead"])
def test_a_reader_that_lost_track_gets_a_snapshot(reader: str) -> None:
    log = KVEventLog(max_events=2)
    for salt in range(4):  # 4 reports, 2 kept: seqs 3 and 4
        log.stored(_digests(1, salt))
    epoch, seq = {"behind": (log.epoch, 1), "other_epoch": ("x" * 16, 4),
                  "ahead": (log.epoch, 9)}[reader]  # fmt: skip
    answer = log.since(epoch, seq)
    assert "events" not in answer and len(answer["snapshot"]) == 4 == log.num_held
    kept = log.since(log.epoch, 2)  # the report after seq 2 is still kept
    assert [e["seq"] for e in kept["events"]] == [3, 4]


def test_the_pool_reports_what_it_publishes_and_evicts() -> None:
    log = KVEventLog()
    pool = BlockPool(4, events=log)
    blocks = pool.allocate(2)
    hashes = _digests(2)
    pool.cache_blocks(blocks, hashes)
    pool.cache_blocks(blocks, hashes)  # already published: nothing new to report
    (event,) = log.since(log.epoch, 0)["events"]
    assert (event["seq"], event["kind"]) == (1, "stored")
    assert sorted(event["digests"]) == sorted(map(wire_digest, hashes))
    pool.free(blocks)  # cached but free: still held
    assert log.num_held == 2
    pool.allocate(4)  # takes every block: the two cached ones are evicted
    removed = log.since(log.epoch, 1)["events"]
    assert [e["kind"] for e in removed] == ["removed"]
    assert sorted(removed[0]["digests"]) == sorted(map(wire_digest, hashes))
    assert log.num_held == 0


def test_a_pool_without_caching_reports_nothing() -> None:
    log = KVEventLog()
    pool = BlockPool(2, enable_caching=False, events=log)
    pool.cache_blocks(pool.allocate(1), _digests(1))
    assert log.since(log.epoch, 0)["events"] == [] and log.num_held == 0
