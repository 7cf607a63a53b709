"""Time the engine's own scheduler: `Scheduler.schedule()` + `update()` of decode steps.

The real engine pays these on every step beside the model call (`ModelRunner.execute`, timed
in measure_step.py); the simulator runs the same scheduler but on a virtual clock, so its cost
enters the profile here: a line through (batch size, seconds) -> fixed + per-request seconds.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from disagg.config import SchedulerConfig
from disagg.engine.block_pool import BlockPool
from disagg.engine.outputs import RunnerOutput
from disagg.engine.request import Request
from disagg.engine.scheduler import Scheduler
from disagg.protocol import SamplingParams

__all__ = ["measure_scheduler"]

_PROMPT_LEN = 64
_TOKEN = 7  # any id that is not a stop token


def _decode_step_s(batch_size: int, num_steps: int) -> float:
    """Median seconds of schedule() + update() once `batch_size` requests are all decoding."""
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=8192)
    blocks_per_request = (_PROMPT_LEN + num_steps + 2) // 16 + 2
    scheduler = Scheduler(config, BlockPool(batch_size * blocks_per_request + 1), 16)
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        scheduler.add_request(Request(f"s{i}", list(range(100, 100 + _PROMPT_LEN)), params))
    times = []
    for step in range(num_steps + 1):
        start = time.perf_counter()
        sched = scheduler.schedule(float(step))
        out = RunnerOutput(sampled_token_ids={s.request_id: _TOKEN for s in sched.requests})
        scheduler.update(sched, out, float(step))
        if step:  # step 0 is the prefill
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_scheduler(
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128), num_steps: int = 50
) -> tuple[float, float]:
    """(fixed seconds per step, seconds per request in the batch)."""
    seconds = [_decode_step_s(b, num_steps) for b in batch_sizes]
    slope, intercept = np.polyfit(np.asarray(batch_sizes, float), np.asarray(seconds), 1)
    return max(float(intercept), 0.0), max(float(slope), 0.0)
