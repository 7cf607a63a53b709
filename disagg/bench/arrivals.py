"""Request arrival process: gamma-distributed inter-arrival gaps at a target rate.

Owns the schedule of when each request is sent (offsets from the start, in seconds). Shape =
burstiness, so burstiness 1 is a Poisson process and the squared coefficient of variation of the
gaps is 1 / burstiness. Sends nothing and reads no clock.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["arrival_offsets_s", "inter_arrival_gaps_s"]


def inter_arrival_gaps_s(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Gaps between consecutive requests, seconds; all 0 at an infinite rate.

    Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, CV^2 = 1/burstiness.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf for all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [float(g) for g in rng.gamma(shape=burstiness, scale=scale, size=num_requests)]


def arrival_offsets_s(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send time of each request relative to the benchmark start, seconds, non-decreasing.

    The first request goes at 0; request i waits the gaps drawn for requests 0..i-1.
    """
    gaps = inter_arrival_gaps_s(num_requests, request_rate, burstiness, seed)
    return [0.0] + [float(t) for t in np.cumsum(gaps[:-1])] if gaps else []
