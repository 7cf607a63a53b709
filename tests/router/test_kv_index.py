"""The router's index of the instances' prefix caches: reports and snapshots applied, the
longest cached prefix per instance, bounded memory, malformed answers refused whole."""

from __future__ import annotations

import pytest

from disagg.router.kv_index import KVIndex

P, D = "http://p:1", "http://d:2"


def _d(i: int) -> str:
    return f"{i:016x}"


def _events(seq: int, *reports: tuple[str, list[int]], epoch: str = "e") -> dict[str, object]:
    events = [{"seq": seq, "kind": kind, "digests": [_d(i) for i in ids]} for kind, ids in reports]
    return {"epoch": epoch, "seq": seq, "events": events}


def test_reports_and_snapshots_say_who_holds_which_prefix() -> None:
    index = KVIndex(100)
    index.apply(P, {"epoch": "e", "seq": 2, "snapshot": [_d(1), _d(2), _d(3)]})
    index.apply(D, _events(1, ("stored", [1, 2])))
    assert index.num_cached(P, [_d(1), _d(2), _d(3), _d(4)]) == 3
    assert index.num_cached(D, [_d(1), _d(2), _d(3)]) == 2
    assert index.num_cached(D, [_d(3), _d(1)]) == 0  # the leading blocks only
    index.apply(P, _events(3, ("removed", [2])))
    assert index.num_cached(P, [_d(1), _d(2), _d(3)]) == 1
    assert index.cursor(P) == ("e", 3) and index.cursor("http://new:3") == ("", 0)
    index.apply(D, {"epoch": "e2", "seq": 0, "snapshot": [_d(9)]})  # D restarted
    assert index.num_cached(D, [_d(1)]) == 0 and index.num_cached(D, [_d(9)]) == 1
    assert index.num_held() == {P: 2, D: 1}
    index.forget(P)
    assert index.num_cached(P, [_d(1)]) == 0 and index.followed() == {D}


def test_memory_stays_bounded_with_more_blocks_than_the_bound() -> None:
    index = KVIndex(max_digests=64)
    for seq in range(1, 101):  # 100 reports of 10 fresh digests each: 1,000 > 64
        index.apply(P, _events(seq, ("stored", list(range(seq * 10, seq * 10 + 10)))))
        assert len(index) <= 64
    newest = [_d(i) for i in range(1000, 1010)]
    assert index.num_cached(P, newest) == 10  # the latest stored are the ones kept
    assert index.num_cached(P, [_d(10)]) == 0  # the oldest were forgotten


@pytest.mark.parametrize(
    "answer",
    [
        [],
        {"epoch": 1, "seq": 0, "snapshot": []},
        {"epoch": "e", "seq": -1, "snapshot": []},
        {"epoch": "e", "seq": 1},
        {"epoch": "e", "seq": 1, "snapshot": ["XYZ"]},
        {"epoch": "e", "seq": 1, "block_size": 0, "snapshot": []},
        {"epoch": "e", "seq": 1, "events": [{"kind": "stored", "digests": [_d(1)]}, {"kind": "x"}]},
    ],
)
def test_a_malformed_answer_is_refused_and_changes_nothing(answer: object) -> None:
    index = KVIndex(10)
    index.apply(P, _events(1, ("stored", [5])))
    with pytest.raises(ValueError):
        index.apply(P, answer)
    assert index.num_cached(P, [_d(5)]) == 1 and index.num_cached(P, [_d(1)]) == 0
    assert index.cursor(P) == ("e", 1)
