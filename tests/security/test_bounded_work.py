"""Bounded work per request: no request may stall an instance or the router for long, kill an
instance by memory, or grow the per-token work with lists the client controls.

Each test is an adversarial run's finding: a 15 MB prompt was tokenized holding the GIL for 17 s
(/health blocked, the router dropped both instances, another client's stream stalled 19 s); under
a 3.5 GB address-space limit one 10 MB prompt aborted the instance; 1.5M stop_token_ids raised
another stream's inter-token gap 1.6 -> 26 ms; 1000 stop strings of 2000 characters took 18.5 s.
Unit checks first (parsers, the instance app over a fake engine, the router over a fake
instance), then real processes: a router and instances on loopback.
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.config import RouterConfig, ServerConfig
from disagg.protocol import RequestOutput
from disagg.router import main as router_main
from disagg.router.app import make_app as make_router_app
from disagg.server import main as server_main
from disagg.server.app import make_app as make_instance_app
from disagg.server.openai_api import (
    MAX_NUM_STOP,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_STOP_CHARS,
    APIError,
    parse_chat_request,
    parse_completion_request,
)
from disagg.server.output_processor import OutputProcessor
from disagg.server.prompt_limits import PROMPT_CHARS_PER_TOKEN
from disagg.server.tokenizer import Tokenizer
from tests.e2e.client import completion_body, open_stream, prompt_ids
from tests.e2e.cluster import Cluster, Proc
from tests.router.fakes import FakeInstance, run_async, running
from tests.security.test_api_edges import error_of, with_client
from tests.server.fakes import ScriptedEngine, make_tokenizer_dir

ADDRESS_SPACE_BYTES = int(3.5 * 2**30)  # the limit the instance died under
BIG_PROMPT_CHARS = 15_000_000
HEALTH_TIMEOUT_S = 2.0  # the router's own /health probe timeout (PROBE_TIMEOUT_S)


class CountingTokenizer(Tokenizer):
    """The real tokenizer, counting the characters it was asked to tokenize or render."""

    num_chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_chars += len(text)
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
        self.num_chars += sum(len(m["content"]) for m in messages)
        return super().apply_chat_template(messages, add_generation_prompt)


@pytest.fixture
def tokenizer(tmp_path: Path) -> CountingTokenizer:
    return CountingTokenizer.from_dir(make_tokenizer_dir(tmp_path / "tok"))  # type: ignore[return-value]


def refusal(parse: Any, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


# ---- B: caps on client-controlled lists --------------------------------------------------------


def test_stop_strings_are_capped_in_number_and_length() -> None:
    """1000 stop strings of 2000 characters (18.5 s of matching): refused 400 naming `stop`,
    for either endpoint; the caps themselves are accepted."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for parse, base in ((parse_completion_request, {"prompt": "x"}), (parse_chat_request, chat)):
        for stop in (["s" * 2000] * 1000, [f"s{i}" for i in range(MAX_NUM_STOP + 1)],
                     ["s" * (MAX_STOP_CHARS + 1)]):  # fmt: skip
            assert refusal(parse, {**base, "stop": stop}).param == "stop"
        stop = ["s" * MAX_STOP_CHARS] * MAX_NUM_STOP
        assert parse({**base, "stop": stop}).sampling.stop == tuple(stop)


def test_stop_token_ids_are_capped_and_a_set() -> None:
    """1.5M stop_token_ids (scanned on the engine loop for every sampled token): 400 naming
    `stop_token_ids`; a list within the cap becomes a frozenset, so the check per token is one
    hash lookup whatever its size."""
    error = refusal(parse_completion_request, {"prompt": "x", "stop_token_ids": [5] * 1_500_000})
    assert error.param == "stop_token_ids"
    too_many = list(range(MAX_NUM_STOP_TOKEN_IDS + 1))
    assert refusal(parse_completion_request, {"prompt": "x", "stop_token_ids": too_many}).param
    ids = list(range(MAX_NUM_STOP_TOKEN_IDS))
    sampling = parse_completion_request({"prompt": "x", "stop_token_ids": ids}).sampling
    assert sampling.stop_token_ids == frozenset(ids)
    assert isinstance(sampling.stop_token_ids, frozenset)


def test_stop_matching_scans_only_the_new_tail(tokenizer: Tokenizer) -> None:
    """The most stop strings of the longest length, the last one matched by the output for all
    but its last character (so that much text stays held back): the work per token stays near
    that of a request without stop strings. Before, each token compared every held length with
    every stop string again (~100x the plain time here; 1000 x 2000 characters took 18 s)."""
    a_ids = tokenizer.encode("a", add_special_tokens=False)
    stop = ["b" * MAX_STOP_CHARS] * (MAX_NUM_STOP - 1) + ["a" * (MAX_STOP_CHARS - 1) + "b"]

    def feed(stop: list[str]) -> float:
        proc = OutputProcessor(tokenizer, [], stop)
        started = time.perf_counter()
        for _ in range(3000):
            assert proc.process(RequestOutput("r", a_ids)).finish_reason is None
        assert len(proc.text) == 3000 - (MAX_STOP_CHARS - 1 if stop else 0)  # the rest held
        return time.perf_counter() - started

    plain_s = feed([])
    assert feed(stop) < 10 * plain_s + 0.25


# ---- A: prompt size checked before tokenizing, on the instance --------------------------------


def instance_app(tokenizer: Tokenizer, **kwargs: Any) -> tuple[ScriptedEngine, Any]:
    engine = ScriptedEngine(output_ids=tokenizer.encode("Hello world", add_special_tokens=False))
    if isinstance(tokenizer, CountingTokenizer):
        tokenizer.num_chars = 0  # count only what the app tokenizes
    return engine, lambda: make_instance_app(engine, tokenizer, **kwargs)


def test_instance_refuses_a_long_prompt_before_tokenizing(tokenizer: CountingTokenizer) -> None:
    """Text over max_model_len x PROMPT_CHARS_PER_TOKEN characters, chat messages whose
    contents add up to more (or that are too many), and token ids past max_model_len: 400 in
    the OpenAI shape naming the field, and not one character reaches the tokenizer (15 MB used
    to take 17 s there)."""
    engine, app = instance_app(tokenizer)
    limit = engine.max_model_len * PROMPT_CHARS_PER_TOKEN
    half = "w" * (limit // 2 + 1)
    messages = [{"role": "system", "content": half}, {"role": "user", "content": half}]
    cases = [
        ("/v1/completions", {"prompt": "w" * (limit + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["w" * BIG_PROMPT_CHARS]}, "prompt"),
        ("/v1/chat/completions", {"messages": messages}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": half}, {"type": "text", "text": half}]}]}, "messages"),
        # Empty messages still render to markup: each counts as a token's worth of characters.
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * (
            engine.max_model_len + 1)}, "messages"),
        # Out-of-vocabulary ids too: the length is refused before any id is looked at.
        ("/v1/completions", {"prompt": [10**9] * engine.max_model_len}, "prompt"),
    ]  # fmt: skip

    async def test(client: TestClient) -> None:
        for path, body, param in cases:
            async with client.post(path, json=body) as resp:
                error = await error_of(resp, 400)
            assert (error["param"], error["code"]) == (param, "context_length_exceeded"), body
        assert tokenizer.num_chars == 0
        async with client.post("/v1/completions", json={"prompt": "w" * limit}) as resp:
            await error_of(resp, 400)  # at the bound: tokenized, then too many tokens
        assert tokenizer.num_chars == limit

    with_client(app, test)
    assert engine.submitted == []


def test_instance_prompt_char_limit_can_be_set(tokenizer: CountingTokenizer) -> None:
    """`max_prompt_chars` overrides the bound derived from max_model_len, both ways."""
    engine, small = instance_app(tokenizer, max_prompt_chars=10)

    async def refused(client: TestClient) -> None:
        async with client.post("/v1/completions", json={"prompt": "w" * 11}) as resp:
            assert (await error_of(resp, 400))["param"] == "prompt"
        async with client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}) as r:
            assert r.status == 200

    with_client(small, refused)
    limit = engine.max_model_len * PROMPT_CHARS_PER_TOKEN
    _, large = instance_app(tokenizer, max_prompt_chars=limit * 4)

    async def tokenized(client: TestClient) -> None:
        async with client.post("/v1/completions", json={"prompt": "w" * (limit + 1)}) as resp:
            assert (await error_of(resp, 400))["param"] == "prompt"
        assert tokenizer.num_chars == limit + 1

    with_client(large, tokenized)


def test_router_refuses_a_long_prompt_before_any_leg() -> None:
    """The router has no tokenizer and no max_model_len: it refuses prompts over its own
    max_prompt_chars (text, and chat contents in all), without sending a leg."""
    fake = FakeInstance("both")
    cases = [
        ("/v1/completions", {"prompt": "w" * 101}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w" * 60}] * 2},
         "messages"),
    ]  # fmt: skip

    async def main() -> None:
        async with running(fake) as (url,):
            cfg = RouterConfig(host="127.0.0.1", port=0, decode_urls=(url,), max_prompt_chars=100)
            async with TestClient(TestServer(make_router_app(cfg))) as client:
                for path, body, param in cases:
                    async with client.post(path, json=body) as resp:
                        error = await error_of(resp, 400)
                    assert error["param"] == param
                async with client.post("/v1/completions", json={"prompt": "w" * 100}) as resp:
                    assert resp.status == 200

    run_async(main(), timeout_s=60)
    assert [r.body["prompt"] for r in fake.received] == ["w" * 100]


def test_prompt_char_limits_are_flags() -> None:
    """`disagg serve --max-prompt-chars` and `disagg route --max-prompt-chars`: 0 = derived
    (instance) or off (router); a negative value is refused."""
    serve, route = argparse.ArgumentParser(), argparse.ArgumentParser()
    server_main.add_arguments(serve)
    router_main.add_arguments(route)
    _, server = server_main.build_configs(serve.parse_args(["--max-prompt-chars", "5000"]))
    assert server.max_prompt_chars == 5000
    assert ServerConfig().max_prompt_chars == 0
    args = route.parse_args(["--decode", "http://127.0.0.1:9", "--max-prompt-chars", "0"])
    assert router_main.build_config(args).max_prompt_chars == 0
    assert RouterConfig(decode_urls=("http://x:1",)).max_prompt_chars == 131072 * 16
    with pytest.raises(ValueError, match="max_prompt_chars"):
        ServerConfig(max_prompt_chars=-1)


def test_tokenizing_a_long_prompt_lets_other_threads_run(tokenizer: Tokenizer) -> None:
    """The tokenizer works with the GIL released, so the event loop and the engine loop go on
    while a big prompt is tokenized on a worker thread (before, 2M characters held every other
    thread for ~1.4 s). Measured as a share of the call's own time, so load does not matter."""
    text = "the quick brown fox jumps over the lazy dog " * 25_000  # 1.1M characters
    gaps_s: list[float] = []
    is_done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not is_done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps_s.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    started = time.perf_counter()
    assert len(tokenizer.encode(text)) > 100_000
    elapsed_s = time.perf_counter() - started
    is_done.set()
    ticker.join()
    assert max(gaps_s) < 0.5 * elapsed_s, (max(gaps_s), elapsed_s)


# ---- real processes ----------------------------------------------------------------------------


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


@pytest.fixture(scope="module")
def procs(cluster: Cluster) -> dict[str, Proc]:
    """An aggregated instance behind a router, and one more under the address-space limit."""
    instance = cluster.serve("instance")
    limited = cluster.serve("limited", preexec=_limit_address_space)
    cluster.wait_ready(instance, limited)
    router = cluster.route("router", [], [instance], mode="aggregated")
    return {"instance": instance, "limited": limited, "router": router}


def post_raw(url: str, path: str, data: bytes, timeout_s: float = 60.0) -> tuple[int, Any, float]:
    """POST pre-encoded JSON; (status, parsed body, seconds until the whole answer was read)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    started = time.monotonic()
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    return resp.status, json.loads(raw), time.monotonic() - started


def big_bodies() -> list[tuple[str, bytes]]:
    """(path, body) of a 15 MB text prompt and a 15 MB chat message."""
    text = ("the quick brown fox jumps over the lazy dog " * (BIG_PROMPT_CHARS // 44 + 1))[
        :BIG_PROMPT_CHARS
    ]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return [
        ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 4}).encode()),
        ("/v1/chat/completions", json.dumps(chat).encode()),
    ]


class TimedStream:
    """Another client's stream through the router, read on a thread; records event times."""

    def __init__(self, url: str, num_tokens: int) -> None:
        body = completion_body(prompt_ids(7, 16), num_tokens, stream=True)
        self._opened = open_stream(url, body)
        self.times_s: list[float] = []
        self.events: list[Any] = []
        self.started = threading.Event()  # a few tokens arrived: it is decoding
        self._is_stopping = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._opened.events():
                self.times_s.append(time.monotonic())
                self.events.append(event)
                if len(self.times_s) == 5:
                    self.started.set()
                if self._is_stopping.is_set():
                    break  # hang up from this thread, not under its feet
        finally:
            self.started.set()
            self._opened.close()

    def max_gap_s(self, *, hang_up: bool = False) -> float:
        """The longest gap between two events, once the stream ended (or we hung up)."""
        if hang_up:
            self._is_stopping.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "stream did not finish"
        assert len(self.times_s) > 20, f"only {len(self.times_s)} events: {self.events[:3]}"
        return max(b - a for a, b in zip(self.times_s, self.times_s[1:], strict=False))


def health_latency_s(*procs: Proc) -> float:
    """The slowest /health among `procs`; each must answer 200 within the router's timeout."""
    slowest = 0.0
    for proc in procs:
        started = time.monotonic()
        assert proc.get_status("/health") == 200, proc.name
        slowest = max(slowest, time.monotonic() - started)
    return slowest


@pytest.mark.slow
def test_big_prompt_is_refused_fast_while_another_stream_flows(procs: dict[str, Proc]) -> None:
    """A 15 MB text prompt and a 15 MB chat message, to the router and to the instance
    directly: each answered 400 within a second; meanwhile /health answers on both and another
    client's stream through the router keeps its pace (before: 17 s to the 400, /health blocked
    ~17 s, the other stream stalled 19 s)."""
    router, instance = procs["router"], procs["instance"]
    baseline_gap_s = TimedStream(router.url, 100).max_gap_s()  # (1) its pace, undisturbed
    bodies = big_bodies()
    stream = TimedStream(router.url, 3000)  # (2) again, the big prompts sent meanwhile
    assert stream.started.wait(60)
    for target in (router, instance):
        for path, data in bodies:
            status, body, elapsed_s = post_raw(target.url, path, data)
            assert status == 400, body
            assert body["error"]["param"] == ("prompt" if "chat" not in path else "messages")
            assert elapsed_s < 1.0, f"{target.name} {path}: {elapsed_s:.2f}s"
            assert health_latency_s(router, instance) < HEALTH_TIMEOUT_S
    assert stream.max_gap_s(hang_up=True) < 2 * baseline_gap_s + 1.0  # (3) no stall


@pytest.mark.slow
def test_max_size_prompt_is_short_work(procs: dict[str, Proc]) -> None:
    """A prompt right at the character bound is tokenized (off the event loop) and refused for
    its token count within a few seconds, /health answering meanwhile; then a normal request."""
    instance = procs["instance"]
    max_model_len = instance.get_json("/v1/models")["data"][0]["max_model_len"]
    text = "x " * (max_model_len * PROMPT_CHARS_PER_TOKEN // 2)
    data = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    status, body, elapsed_s = post_raw(instance.url, "/v1/completions", data)
    assert status == 400 and "tokens" in body["error"]["message"], body
    assert elapsed_s < 5.0
    assert health_latency_s(instance) < HEALTH_TIMEOUT_S


@pytest.mark.slow
def test_instance_under_an_address_space_limit_survives_a_10mb_prompt(
    procs: dict[str, Proc],
) -> None:
    """RLIMIT_AS 3.5 GB: a 10 MB text prompt and a 10 MB chat message are refused 400 (before,
    tokenizing one peaked at 4.9 GB and aborted the process); the instance then still serves."""
    limited = procs["limited"]
    text = "lorem ipsum dolor sit amet " * (10_000_000 // 27)
    chat = {"messages": [{"role": "user", "content": text}]}
    for path, body in (("/v1/completions", {"prompt": text}), ("/v1/chat/completions", chat)):
        status, answer, _ = post_raw(limited.url, path, json.dumps(body).encode())
        assert status == 400, answer
        assert limited.is_alive, limited.describe()
    data = json.dumps(completion_body(prompt_ids(3, 16), 4)).encode()
    status, answer, _ = post_raw(limited.url, "/v1/completions", data)
    assert status == 200 and answer["choices"][0]["text"], answer
    assert limited.is_alive


@pytest.mark.slow
def test_tiny_top_p_samples_the_top_token(procs: dict[str, Proc]) -> None:
    """top_p=1e-300 (it rounds to 0 in float32) used to drop every token, the top one too:
    HTTP 500 "sampling found no valid distribution". It is the greedy answer."""
    instance = procs["instance"]
    greedy = completion_body(prompt_ids(5, 16), 6)
    sampled = {**greedy, "temperature": 1.0, "top_p": 1e-300}
    answers = [post_raw(instance.url, "/v1/completions", json.dumps(b).encode())
               for b in (greedy, sampled)]  # fmt: skip
    assert [status for status, _, _ in answers] == [200, 200], answers
    texts = [body["choices"][0]["text"] for _, body, _ in answers]
    assert texts[0] == texts[1]
