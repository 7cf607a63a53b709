"""AsyncEngine on a real tiny checkpoint: what the HTTP side sees of the loop thread."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.block_pool import hash_blocks
from disagg.engine.kv_events import wire_digest
from disagg.protocol import (
    FinishReason,
    RequestFencedError,
    RequestIdInUseError,
    RequestOutput,
    SamplingParams,
)
from disagg.server.app import make_app, start_server
from disagg.server.tokenizer import Tokenizer

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


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


async def _until_forgotten(engine: AsyncEngine, timeout_s: float = 5.0) -> None:
    """The caller's ids stop resolving once the engine holds nothing under them (leak check)."""
    deadline = time.monotonic() + timeout_s
    while engine._engine_ids:
        assert time.monotonic() < deadline, f"ids still resolve: {engine._engine_ids}"
        await asyncio.sleep(0.01)


def test_a_reused_request_id_never_receives_the_old_requests_output(
    tiny_qwen3_dir: Path,
) -> None:
    """Regression: client A streams as X and hangs up, client B sends X at once. Output queues
    were keyed by the id alone: A's queue was popped, B's took its place under X, and A's
    in-flight outputs and its abort landed in B's queue (B got A's tokens and `abort`)."""

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir))
        await engine.start()
        try:
            a = engine.generate("X", [5, 6, 7], _params(200))
            await anext(a)  # (1) A is decoding
            await engine.abort("X")  # (2) A's client hangs up: the server aborts, then closes
            await a.aclose()
            b = [o async for o in engine.generate("X", [8, 9, 10], _params(4))]  # (3) at once
            alone = [o async for o in engine.generate("Y", [8, 9, 10], _params(4))]
            await _until_forgotten(engine)  # (4) no id still resolves once the engine let go
        finally:
            await engine.shutdown()
        return b, alone

    b, alone = asyncio.run(main())
    assert b[-1].finish_reason is FinishReason.LENGTH, b[-1]
    assert _tokens(b) == _tokens(alone)  # B's own tokens, none of A's
    assert {o.request_id for o in b} == {"X"}  # the id the caller gave is the one reported


def test_a_request_id_still_streaming_is_refused_as_in_use(tiny_qwen3_dir: Path) -> None:
    """While A's stream is open under X, a second X is refused (the server answers 409); once
    A has finished, X is free again."""

    async def main() -> list[RequestOutput]:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir))
        await engine.start()
        try:
            a = engine.generate("X", [5, 6, 7], _params(3))
            first = await anext(a)
            with pytest.raises(RequestIdInUseError):
                await anext(engine.generate("X", [8, 9], _params(2)))
            rest = [first, *[o async for o in a]]
            assert rest[-1].finish_reason is FinishReason.LENGTH
            return [o async for o in engine.generate("X", [8, 9], _params(2))]
        finally:
            await engine.shutdown()

    again = asyncio.run(main())
    assert again[-1].finish_reason is FinishReason.LENGTH and len(_tokens(again)) == 2


def test_a_fenced_abort_refuses_a_late_submission_and_aborts_a_held_one(
    tiny_qwen3_dir: Path,
) -> None:
    """The router asks "abort X, and if you do not hold it, never take it" when its client
    left after D's leg went out: a handler still reading or tokenizing that leg must then be
    refused at submission (the router releases P's lease on the answer), and a request the
    engine holds is aborted as by a plain abort (its own release covers P)."""

    async def main() -> tuple[bool, bool, RequestOutput]:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir))
        await engine.start()
        try:
            was_held = await engine.fence("late")  # the leg's handler has not submitted yet
            with pytest.raises(RequestFencedError):
                await anext(engine.generate("late", [5, 6, 7], _params(2)))
            running = engine.generate("held", [5, 6, 7], _params(200))
            await anext(running)
            is_held = await engine.fence("held")
            last = await _last(running)
        finally:
            await engine.shutdown()
        return was_held, is_held, last

    was_held, is_held, last = asyncio.run(main())
    assert (was_held, is_held) == (False, True)
    assert last.finish_reason is FinishReason.ABORT


def _metric(text: str, name: str) -> float:
    rows = [row for row in text.splitlines() if row.startswith(name + " ")]
    return float(rows[0].split()[-1]) if rows else 0.0


def test_over_http_a_reused_id_gets_its_own_answer(tiny_qwen3_dir: Path) -> None:
    """The race of test_a_reused_request_id_never_receives_the_old_requests_output through the
    server: A streams with `X-Request-Id: X` and hangs up, B sends X at once (while the engine
    loop is still in the step that makes A's next token) and got HTTP 200 with A's tokens and
    finish_reason abort. B must get its own answer."""
    aborted = 'disagg_requests_total{finish_reason="abort"}'

    async def main() -> tuple[int, dict, dict]:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir))
        await engine.start()
        app = make_app(engine, Tokenizer.from_dir(tiny_qwen3_dir))
        runner, port = await start_server(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1/completions"
        step, parked, release = engine.engine.step, threading.Event(), threading.Event()

        def parked_step() -> list[RequestOutput]:
            parked.set()
            release.wait(5.0)
            return step()

        body = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        b_body = {**body, "prompt": [8, 9, 10], "max_tokens": 4}
        try:
            async with aiohttp.ClientSession() as session:
                a = await session.post(url, json={**body, "stream": True},
                                       headers={"X-Request-Id": "X"})  # fmt: skip
                await a.content.readline()  # (1) A is decoding
                engine.engine.step = parked_step
                assert await asyncio.to_thread(parked.wait, 5.0)  # the loop is inside a step
                a.close()  # (2) A hangs up; its handler aborts and closes its stream
                deadline = time.monotonic() + 5.0
                while _metric(await (await session.get(url.replace("/v1/completions",
                              "/metrics"))).text(), aborted) < 1:  # fmt: skip
                    assert time.monotonic() < deadline, "A's handler never ended"
                    await asyncio.sleep(0.02)
                b = asyncio.create_task(session.post(url, json=b_body,
                                                     headers={"X-Request-Id": "X"}))  # fmt: skip
                await asyncio.sleep(0.2)  # (3) B is submitted while the step still runs
                engine.engine.step = step
                release.set()
                b_resp = await asyncio.wait_for(b, 10.0)
                b_answer = await b_resp.json()
                alone = await (await session.post(url, json=b_body)).json()
        finally:
            release.set()
            await runner.cleanup()
            await engine.shutdown()
        return b_resp.status, b_answer, alone

    status, b_answer, alone = asyncio.run(main())
    assert status == 200, b_answer
    assert b_answer["choices"][0]["finish_reason"] == "length", b_answer
    assert b_answer["choices"][0]["text"] == alone["choices"][0]["text"]
    assert b_answer["id"] == "X"


def test_over_http_an_id_still_streaming_gets_409(tiny_qwen3_dir: Path) -> None:
    """A second request under the id of one still streaming is a conflict (409, OpenAI error
    shape), not a bad request: it is refused without touching the first."""

    async def main() -> tuple[int, dict, list[bytes]]:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir))
        await engine.start()
        app = make_app(engine, Tokenizer.from_dir(tiny_qwen3_dir))
        runner, port = await start_server(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        headers = {"X-Request-Id": "X"}
        try:
            async with aiohttp.ClientSession() as session:
                a = await session.post(url, json={**body, "stream": True}, headers=headers)
                await a.content.readline()  # A is streaming
                b = await session.post(url, json=body, headers=headers)
                b_answer = await b.json()
                rest = [line async for line in a.content if line.startswith(b"data: ")]
        finally:
            await runner.cleanup()
            await engine.shutdown()
        return b.status, b_answer, rest

    status, answer, rest = asyncio.run(main())
    assert status == 409, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert rest[-1] == b"data: [DONE]\n"
    assert b'"finish_reason":"length"' in rest[-2]  # A streamed on, untouched


def test_the_prefix_cache_is_published_as_kv_events(tiny_qwen3_dir: Path) -> None:
    """A real engine: the prompt's full blocks appear in /kv/events' answer once computed,
    under the same chained digests the block pool keys them by (the router's index matches
    a prompt by them)."""
    prompt = list(range(100, 140))  # 2 full blocks of 16, and 8 tokens more

    async def main() -> dict[str, object]:
        engine = AsyncEngine(_tiny_config(tiny_qwen3_dir), str(tiny_qwen3_dir))
        await engine.start()
        try:
            empty = engine.kv_events("", 0)
            await _last(engine.generate("a", prompt, _params(2)))
            return {"empty": empty, "after": engine.kv_events(empty["epoch"], empty["seq"])}
        finally:
            await engine.shutdown()

    answers = asyncio.run(main())
    assert answers["empty"]["snapshot"] == []
    stored = {d for e in answers["after"]["events"] if e["kind"] == "stored" for d in e["digests"]}
    expected = [wire_digest(h) for h in hash_blocks(None, prompt, 16)]
    assert len(expected) == 2 and set(expected) <= stored
