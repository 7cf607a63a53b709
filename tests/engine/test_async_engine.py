"""AsyncEngine on a real tiny checkpoint: what the HTTP side sees of the loop thread."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.async_engine import AsyncEngine
from disagg.protocol import RequestOutput, SamplingParams

SLOW_STEP_S = 0.4


async def _last(stream: object) -> RequestOutput:
    last = None
    async for output in stream:  # type: ignore[attr-defined]
        last = output
    assert last is not None
    return last


def test_queue_time_counts_the_wait_for_the_step_in_progress(tiny_qwen3_dir: Path) -> None:
    """A request submitted while the loop runs a long step waits for that step; its queue_s
    must include the wait (it used to start counting only when the loop picked it up)."""
    config = EngineConfig(
        model=str(tiny_qwen3_dir),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256),
    )

    async def main() -> None:
        engine = AsyncEngine(config, str(tiny_qwen3_dir))
        await engine.start()
        in_step = threading.Event()
        step = engine.engine.step

        def slow_first_step() -> list[RequestOutput]:
            if not in_step.is_set():
                in_step.set()
                time.sleep(SLOW_STEP_S)  # a long prefill step, as on a loaded instance
            return step()

        engine.engine.step = slow_first_step
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            first = asyncio.create_task(_last(engine.generate("a", [5, 6, 7], params)))
            assert await asyncio.to_thread(in_step.wait, 5.0)
            submitted = time.monotonic()
            second = await _last(engine.generate("b", [8, 9, 10], params))
            await first
        finally:
            await engine.shutdown()
        queue_s = second.breakdown.queue_s
        assert queue_s is not None
        # It waited for (most of) the slow step before the loop could even see it.
        assert queue_s >= SLOW_STEP_S / 2, queue_s
        assert queue_s <= time.monotonic() - submitted

    asyncio.run(main())
