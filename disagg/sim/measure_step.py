"""Time the engine's own model step: `ModelRunner.execute` on hand-built `SchedulerOutput`s.

Imports torch, the only sim module that does: `disagg sim calibrate` loads it lazily. One torch
thread, as each instance ran in the measured sweep.
Each shape is run once to warm up, then `repeats` times; the median is kept.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from disagg.config import CacheConfig, EngineConfig
from disagg.engine.model_runner import ModelRunner
from disagg.engine.outputs import ScheduledRequest, SchedulerOutput
from disagg.protocol import SamplingParams
from disagg.sim.fitted_step import StepSample, step_features
from disagg.sim.model_shape import ModelShape

__all__ = ["StepGrid", "measure_memory_bandwidth", "measure_steps"]

_BLOCK_SIZE = 16
_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

# (num_tokens, context_len, do_sample) per request of one step
Batch = list[tuple[int, int, bool]]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepGrid:
    prefill_lens: tuple[int, ...] = (64, 256, 1024, 2048, 4096)  # one chunk, empty cache
    prefill_contexts: tuple[int, ...] = (1024,)  # a 1024-token chunk after this many cached
    decode_batches: tuple[int, ...] = (1, 4, 16, 32)
    decode_contexts: tuple[int, ...] = (128, 1024, 4095)  # tokens cached before the new one
    repeats: int = 3

    def batches(self) -> list[Batch]:
        out: list[Batch] = [[(n, 0, True)] for n in self.prefill_lens]
        out += [[(1024, ctx, True)] for ctx in self.prefill_contexts]
        out += [[(1, c, True)] * b for b in self.decode_batches for c in self.decode_contexts]
        return out

    def mixed_batches(self) -> list[Batch]:
        """Prefill chunk beside running decodes (aggregated steps): held out of the fit, to
        check that the sum form adds up."""
        return [[(1024, 0, True)] + [(1, 1024, True)] * 8, [(256, 0, True)] + [(1, 256, True)] * 16]

    def num_blocks(self) -> int:
        """Blocks the largest step holds (each request gets its own)."""
        biggest = max(self.batches() + self.mixed_batches(), key=_num_blocks_of)
        return _num_blocks_of(biggest) + 1


def _num_blocks_of(batch: Batch) -> int:
    return sum(-(-(n + ctx) // _BLOCK_SIZE) for n, ctx, _ in batch)


def _sched_output(batch: Batch, vocab_size: int, gen: torch.Generator) -> SchedulerOutput:
    """Prefills first, decodes last, each request on its own run of blocks (as a fresh pool
    hands them out)."""
    requests, next_block = [], 1  # block 0 is the runner's padding block
    for index, (num_tokens, context_len, do_sample) in enumerate(batch):
        blocks = -(-(num_tokens + context_len) // _BLOCK_SIZE)
        ids = torch.randint(100, vocab_size, (num_tokens,), generator=gen).tolist()
        requests.append(
            ScheduledRequest(
                request_id=f"c{index}",
                token_ids=ids,
                start_pos=context_len,
                block_ids=list(range(next_block, next_block + blocks)),
                do_sample=do_sample,
                sampling=_SAMPLING,
                output_index=0,
            )
        )
        next_block += blocks
    return SchedulerOutput(requests=requests, num_scheduled_tokens=sum(n for n, _, _ in batch))


def _time_step(runner: ModelRunner, sched: SchedulerOutput, repeats: int) -> float:
    runner.execute(sched)  # warm-up: first-touch of the blocks, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(sched)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_steps(
    model_dir: str, shape: ModelShape, dtype: str, grid: StepGrid
) -> tuple[list[StepSample], list[StepSample]]:
    """(samples to fit, held-out mixed samples), each a timed `ModelRunner.execute`."""
    torch.set_num_threads(1)
    config = EngineConfig(
        model=model_dir,
        dtype=dtype,
        num_threads=1,
        cache=CacheConfig(block_size=_BLOCK_SIZE, num_blocks=grid.num_blocks()),
    )
    runner = ModelRunner(config, model_dir)
    gen = torch.Generator().manual_seed(0)
    weight_bytes = shape.weight_bytes(1)

    def sample(batch: Batch) -> StepSample:
        sched = _sched_output(batch, shape.vocab_size, gen)
        seconds = _time_step(runner, sched, grid.repeats)
        return StepSample(step_features(shape, batch), weight_bytes, seconds)

    return [sample(b) for b in grid.batches()], [sample(b) for b in grid.mixed_batches()]


def measure_memory_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s one thread streams: a large copy reads and writes each byte once."""
    torch.set_num_threads(1)
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times)
