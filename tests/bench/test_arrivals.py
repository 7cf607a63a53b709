"""Gamma arrivals: mean rate and dispersion (CV^2 = 1/burstiness) over many samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from disagg.bench.arrivals import arrival_offsets_s, inter_arrival_gaps_s


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_mean_rate_and_dispersion(burstiness: float) -> None:
    gaps = np.array(inter_arrival_gaps_s(20000, request_rate=8.0, burstiness=burstiness, seed=1))
    assert abs(gaps.mean() - 1 / 8.0) < 0.04 * (1 / 8.0)  # mean gap = 1 / rate
    cv2 = gaps.var() / gaps.mean() ** 2
    assert abs(cv2 - 1 / burstiness) < 0.1 * (1 / burstiness)


def test_offsets_start_at_zero_and_are_seeded() -> None:
    a = arrival_offsets_s(50, 10.0, 1.0, seed=3)
    assert a == arrival_offsets_s(50, 10.0, 1.0, seed=3)
    assert a != arrival_offsets_s(50, 10.0, 1.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = inter_arrival_gaps_s(50, 10.0, 1.0, seed=3)
    assert a[-1] == pytest.approx(sum(gaps[:-1]))


def test_infinite_rate_sends_all_at_once() -> None:
    assert arrival_offsets_s(4, math.inf) == [0.0] * 4
    assert arrival_offsets_s(0, 1.0) == []


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_invalid_arguments(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        inter_arrival_gaps_s(3, rate, burstiness)
