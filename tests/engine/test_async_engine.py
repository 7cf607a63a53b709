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


def _tiny_config(tiny_qwen3_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_qwen3_dir),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256),
    )


def test_abort_of_a_waiting_request_ends_its_stream_while_idle(tiny_qwen3_dir: Path) -> None:
    """An abort drained while the loop has no other work used to leave the aborted stream
    hanging until another request arrived: its final output waited for a step."""

    async def main() -> None:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir))
        await engine.start()
        release = threading.Event()
        step = engine.engine.step

        def held_step() -> list[RequestOutput]:
            release.wait(5.0)  # the request stays unfinished until the abort is queued
            return step()

        engine.engine.step = held_step
        try:
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = engine.generate("a", [5, 6, 7], params)
            first = asyncio.create_task(_last(stream))
            await asyncio.sleep(0.1)
            await engine.abort("a")
            engine.engine.step = step
            release.set()
            last = await asyncio.wait_for(first, 5.0)
        finally:
            await engine.shutdown()
        assert last.finish_reason is not None and last.finish_reason.value == "abort"

    asyncio.run(main())


def test_a_dead_loop_fails_every_request_and_exits_the_process(tiny_qwen3_dir: Path) -> None:
    """If the loop itself dies (not one request: that fails alone), every caller gets an error
    and the process exits non-zero so a supervisor restarts it, instead of living on as a
    zombie that answers 503."""
    exits: list[int] = []

    async def main() -> RequestOutput:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir), exit_on_death=True)
        engine.exit_process = exits.append
        await engine.start()

        def broken_load() -> dict[str, int]:
            raise RuntimeError("scheduler invariant broken")

        engine.engine.scheduler.load = broken_load  # raises on the loop, outside any step
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0)
            last = await asyncio.wait_for(_last(engine.generate("a", [5, 6], params)), 5.0)
            await asyncio.sleep(1.0)  # the exit comes after the errors had time to leave
            assert not engine.is_healthy()
            return last
        finally:
            await engine.shutdown()

    last = asyncio.run(main())
    assert last.error is not None and "engine loop died" in last.error
    assert exits == [70]
