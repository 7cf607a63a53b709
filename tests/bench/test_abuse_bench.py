"""The pure statistics of benchmarks/abuse_bench.py (in abuse_stats.py): which inter-token gaps
fall in a window, their summary, the ratios and the slowest /health. No processes are started."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest

from tests.bench.scripts import BENCHMARKS_DIR


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS_DIR))  # as when abuse_bench.py runs as a script
    importlib.import_module("abuse_bench")  # the script and all it imports still load
    return importlib.import_module("abuse_stats")


def test_gaps_are_within_one_stream_and_overlap_the_window(bench: ModuleType) -> None:
    """Stream 0: chunks at 0, 1, 3, 10 -> gaps 1, 2, 7; stream 1 starts at 11 (its first chunk
    opens no gap: that is its TTFT, not a stall) -> gap 1. A gap counts when it overlaps the
    window, so a stall that began before it and ended in it (7 s, 3 -> 10) is counted."""
    chunks = [(0, 0.0), (0, 1.0), (0, 3.0), (0, 10.0), (1, 11.0), (1, 12.0)]
    assert bench.gaps_overlapping(chunks, 0.0, 20.0) == [1.0, 2.0, 7.0, 1.0]
    assert bench.gaps_overlapping(chunks, 5.0, 6.0) == [7.0]  # inside the 3 -> 10 stall
    assert bench.gaps_overlapping(chunks, 10.2, 10.8) == []  # between streams: no gap
    assert bench.gaps_overlapping(chunks, 2.0, 3.0) == [2.0]  # touching at 3.0 only: not 7


def test_interleaved_streams_keep_their_own_previous_chunk(bench: ModuleType) -> None:
    chunks = [(0, 0.0), (1, 0.5), (0, 1.0), (1, 2.5)]
    assert bench.gaps_overlapping(chunks, 0.0, 3.0) == [1.0, 2.0]


def test_gap_stats_and_ratios(bench: ModuleType) -> None:
    stats = bench.gap_stats([0.001, 0.002, 0.003, 0.010])
    assert stats == {"num_gaps": 4, "median_ms": 2.5, "p99_ms": 9.8, "max_ms": 10.0}
    empty = bench.gap_stats([])
    assert empty == {"num_gaps": 0, "median_ms": None, "p99_ms": None, "max_ms": None}
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(None, 2.0) is None and bench.ratio(1.0, None) is None
    assert bench.ratio(1.0, 0.0) is None  # no baseline to compare with


def test_slowest_health_counts_only_its_window_and_failures(bench: ModuleType) -> None:
    samples = [("prefill", 0.5, 0.002, 200), ("decode", 1.0, 0.004, 200),
               ("prefill", 1.5, 0.030, 0), ("prefill", 3.0, 0.900, 200)]  # fmt: skip
    slowest = bench.slowest_health(samples, "prefill", 1.0, 2.0)
    assert slowest == {"num": 1, "max_ms": 30.0, "failed": 1}
    assert bench.slowest_health(samples, "router", 0.0, 9.0) == {"num": 0, "max_ms": None,
                                                                 "failed": 0}  # fmt: skip
