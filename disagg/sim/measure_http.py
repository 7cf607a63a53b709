"""Time the HTTP path the simulator charges as hops: the project's own router app in front of its
own instance app, on loopback, with an engine that answers at once.

A streamed completion of a prompt of token ids goes client -> router -> instance; the first
SSE token comes back instance -> router -> client. Its time-to-first-token with a zero-time
engine is the sim's two hops (a leg going out, its answer coming back), so a hop is half of it.
The instance detokenizes with the checkpoint's tokenizer, as it serves.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import ClientResponseError, ClientSession

from disagg.config import RouterConfig
from disagg.protocol import FinishReason, KVTransferParams, RequestOutput, SamplingParams
from disagg.router.app import make_app as make_router_app
from disagg.router.app import start_server as start_router
from disagg.server.app import make_app as make_instance_app
from disagg.server.app import start_server as start_instance
from disagg.sim.model_shape import load_shape
from disagg.tokenizer import Tokenizer

__all__ = ["measure_http_hop_s"]

_TOKEN = 300  # an ordinary id of any trained vocabulary
_NUM_OUTPUT_TOKENS = 1


class _InstantEngine:
    """An `EngineClient` whose every request finishes with one token, immediately."""

    model_name = "calibrate"
    max_model_len = 1 << 20
    eos_token_ids: tuple[int, ...] = ()
    dtype = "float32"

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        async def outputs() -> AsyncIterator[RequestOutput]:
            n, last = len(prompt_token_ids), sampling.max_tokens
            for i in range(1, last + 1):
                finish = FinishReason.LENGTH if i == last else None
                yield RequestOutput(request_id, [_TOKEN], finish, n, i)
                await asyncio.sleep(0)  # one token per delta, as the engine loop publishes

        return outputs()

    async def abort(self, request_id: str) -> None:
        return None

    def load(self) -> dict[str, int]:
        keys = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks")
        return dict.fromkeys((*keys, "num_queued_prefill_tokens"), 0)

    def is_healthy(self) -> bool:
        return True

    def kv_info(self) -> dict[str, Any]:
        return {"role": "both"}


async def _token_times_s(session: ClientSession, url: str, payload: dict[str, Any]) -> list[float]:
    """Seconds from sending to each streamed token."""
    start, times = time.perf_counter(), []
    async with session.post(url, json=payload) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter() - start)
    if not times:
        raise RuntimeError("the instance streamed no token")
    return times


async def _streams(model_dir: str, num_tokens: int, repeats: int) -> list[list[float]]:
    """Token times of `repeats` streamed completions through router and instance."""
    tokenizer = Tokenizer.from_dir(model_dir)
    instance, instance_port = await start_instance(
        make_instance_app(_InstantEngine(), tokenizer), "127.0.0.1", 0
    )
    config = RouterConfig(decode_urls=(f"http://127.0.0.1:{instance_port}",), port=0)
    router, router_port = await start_router(make_router_app(config), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{router_port}/v1/completions"
    vocab_size = load_shape(model_dir).vocab_size  # ids the instance accepts
    prompt = [100 + i % (vocab_size - 100) for i in range(num_tokens)]
    payload: dict[str, Any] = {"model": "calibrate", "prompt": prompt}
    payload |= {"max_tokens": _NUM_OUTPUT_TOKENS, "stream": True, "ignore_eos": True}
    try:
        async with ClientSession() as session:
            await _until_routed(session, url, payload)
            return [await _token_times_s(session, url, payload) for _ in range(repeats)]
    finally:
        await router.cleanup()
        await instance.cleanup()


async def _until_routed(session: ClientSession, url: str, payload: dict[str, Any]) -> None:
    """The router admits the instance after its first health poll; this also opens the
    connections, which no later request pays."""
    deadline = time.perf_counter() + 10.0
    while True:
        try:
            await _token_times_s(session, url, payload)
            return
        except ClientResponseError as exc:
            if exc.status < 500 or time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.05)


def measure_http_hop_s(model_dir: str, num_tokens: int = 1024, repeats: int = 30) -> float:
    """Seconds of one simulated hop: half the median zero-engine TTFT through the router."""
    streams = asyncio.run(_streams(model_dir, num_tokens, repeats))
    return statistics.median(times[0] for times in streams) / 2
