"""End to end, real processes: prefill, decode and aggregated instances behind the router.

Proves, for pull and push over nixl and tcp, that greedy output through the router equals an
aggregated instance's (single, 32 concurrent, streamed), that push pairs D's registration with
P's prefill in either order, that a client who hangs up frees every block, that least_loaded
late binding avoids a busy decode instance, and that an incompatible peer is refused at
handshake with the reason in the client's error. Every test ends with every pool full.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from disagg.kv.faults import KVFaults
from tests.conftest import write_tiny
from tests.e2e.client import (
    OpenStream,
    complete,
    completion_body,
    http_request,
    open_stream,
    prompt_ids,
    read_chunks,
    run_all,
    stream,
)
from tests.e2e.cluster import Cluster, Proc, Reference, assert_pools_full
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

# "pull" is the default background setup; "pull-inline" posts READs on D's engine loop.
PULL_NIXL, PULL_TCP = ("pull", "nixl"), ("pull", "tcp")
PULL_INLINE_NIXL = ("pull-inline", "nixl")
PUSH_NIXL, PUSH_TCP = ("push", "nixl"), ("push", "tcp")
PAIRS = [PULL_NIXL, PULL_TCP, PULL_INLINE_NIXL, PUSH_NIXL, PUSH_TCP]
# Push prefill runs chunks of 32 tokens, so a long prompt's prefill spans many engine steps and
# D's registration reliably arrives before it ends.
PUSH_PREFILL_ARGS = ("--max-num-batched-tokens", "32")
LONG_PROMPT_TOKENS = 2000


@dataclass(frozen=True, slots=True)
class Pair:
    """One prefill and one decode instance of a (mode, transport), a router over them, and the
    extra decode instances some tests pair with the same P (started together, so in parallel)."""

    mode: str
    transport: str
    prefill: Proc
    decode: Proc
    router: Proc
    extras: dict[str, Proc]

    @property
    def instances(self) -> tuple[Proc, Proc]:
        return self.prefill, self.decode

    @property
    def connector(self) -> str:
        return self.mode.removesuffix("-inline")


def _pair_id(pair: tuple[str, str]) -> str:
    return "-".join(pair)


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with one more layer: same vocabulary, different KV shape."""
    return write_tiny(tmp_path_factory.mktemp("qwen3-3l"), num_layers=3)


@pytest.fixture(scope="module", params=PAIRS, ids=_pair_id)
def pair(request: pytest.FixtureRequest, cluster: Cluster, aggregated: Proc) -> Iterator[Pair]:
    """P + D + router of one (mode, transport); pytest groups the tests by it, so one pair runs
    at a time."""
    mode, transport = request.param
    name = f"{mode}-{transport}"
    connector = mode.removesuffix("-inline")
    extra = PUSH_PREFILL_ARGS if mode == "push" else ()
    decode_args = ["--pull-setup", "inline"] if mode == "pull-inline" else []
    common = {"connector": connector, "transport": transport}
    prefill = cluster.serve(f"prefill-{name}", role="prefill", args=extra, **common)
    decode = cluster.serve(f"decode-{name}", role="decode", args=decode_args, **common)
    extras = _start_extras(request, cluster, mode, transport)
    cluster.wait_ready()
    router = cluster.route(f"router-{name}", [prefill], [decode], mode=connector)
    yield Pair(mode, transport, prefill, decode, router, extras)
    cluster.stop(router, prefill, decode, *extras.values())


def _start_extras(
    request: pytest.FixtureRequest, cluster: Cluster, mode: str, transport: str
) -> dict[str, Proc]:
    """The decode instances the pair-specific tests below need, by their key."""
    common = {"role": "decode", "connector": mode, "transport": transport}
    if mode == "push":
        late = KVFaults(register_delay_s=1.0).as_env()
        return {"late": cluster.serve(f"decode-late-{transport}", env=late, **common)}
    if mode != "pull" or transport != "nixl":
        return {}
    three_layers = request.getfixturevalue("three_layer_dir")
    return {
        "idle": cluster.serve("decode-idle", **common),
        "model": cluster.serve("decode-other-model", model_dir=three_layers, **common),
        "block_size": cluster.serve(
            "decode-other-block-size", args=["--block-size", "32"], **common
        ),
        "dtype": cluster.serve("decode-bf16", dtype="bfloat16", **common),  # P computes in fp32
    }


# ---- output equals aggregated ----------------------------------------------------------------


def test_single_request_matches_aggregated(pair: Pair, reference: Reference, aggregated: Proc):
    """One greedy request through the router: the aggregated text, from KV that moved (D counts
    a transfer; the breakdown carries transfer_s and bytes), and every pool full after."""
    body = completion_body(prompt_ids(1, 40), 12)
    before = pair.decode.stats()["transfers"]
    answer = complete(pair.router.url, body)
    assert answer.status == 200, answer.body
    assert answer.text == reference(body)
    assert answer.body["usage"]["completion_tokens"] == 12
    breakdown = answer.body["disagg"]["breakdown"]
    assert breakdown["num_bytes"] > 0 and breakdown["transfer_s"] >= 0, breakdown
    assert pair.decode.stats()["transfers"] == before + 1
    assert_pools_full(*pair.instances, aggregated)


def test_concurrent_mixed_requests_match_aggregated(pair: Pair, reference: Reference):
    """32 concurrent requests, prompts of 5..200 tokens, max_tokens 1..40: each equals the
    aggregated output, each handoff was a transfer, and every pool is full after."""
    rng = random.Random(7)
    bodies = [
        completion_body(prompt_ids(100 + i, rng.randint(5, 200)), rng.choice([1, 2, 9, 17, 40]))
        for i in range(32)
    ]
    bodies[0] = completion_body(prompt_ids(99, 5), 1)  # shortest prompt, only P's token
    before = pair.decode.stats()["transfers"]
    answers = run_all(lambda body: complete(pair.router.url, body), bodies)
    expected = run_all(reference, bodies)
    assert [a.status for a in answers] == [200] * 32, [a.body for a in answers if a.status != 200]
    mismatched = [
        i for i, (a, want) in enumerate(zip(answers, expected, strict=True)) if a.text != want
    ]
    assert not mismatched, f"outputs differ from aggregated for requests {mismatched}"
    assert pair.decode.stats()["transfers"] == before + 32
    assert_pools_full(*pair.instances)


def test_streaming_matches_aggregated(pair: Pair, reference: Reference):
    """Streamed (SSE) through the router, four at once: the chunks join to the aggregated
    text, the last chunk has finish_reason length, the stream ends with [DONE]; pools full."""
    bodies = [completion_body(prompt_ids(200 + i, 30 + 25 * i), 10 + 5 * i) for i in range(4)]
    streams = run_all(lambda body: stream(pair.router.url, {**body, "stream": True}), bodies)
    for body, got in zip(bodies, streams, strict=True):
        assert got.status == 200 and got.error is None, got.events
        assert got.is_done and got.finish_reason == "length"
        assert got.text == reference(body)
    assert_pools_full(*pair.instances)


def test_decode_side_reuse_moves_only_missing_blocks(pair: Pair, reference: Reference):
    """A prompt that extends one D already served: D reuses the prompt's full blocks from its
    own cache, the transfer fills only the blocks after them (the bytes say so), and the
    text equals the aggregated one: an offset wrong anywhere in the real connector would put
    KV in the wrong blocks and change it. Pools full after."""
    bs, base = 16, prompt_ids(700, 37)  # two full blocks, and five tokens of a third
    first = complete(pair.router.url, completion_body(base, 4))
    assert first.status == 200 and first.text == reference(completion_body(base, 4))
    block_bytes = first.body["disagg"]["breakdown"]["num_bytes"] // 3
    for extra in (1, 11, 27, 28, 60):
        body = completion_body(base + prompt_ids(710 + extra, extra), 6)
        answer = complete(pair.router.url, body)
        assert answer.status == 200, answer.body
        assert answer.text == reference(body), extra
        breakdown = answer.body["disagg"]["breakdown"]
        assert breakdown["num_reused_tokens"] == 2 * bs, breakdown
        num_blocks = -(-(len(base) + extra) // bs)
        assert breakdown["num_bytes"] == (num_blocks - 2) * block_bytes, breakdown
    assert_pools_full(*pair.instances)


# ---- client disconnects ----------------------------------------------------------------------


def test_client_disconnect_mid_stream_frees_blocks(pair: Pair, reference: Reference):
    """A client that hangs up mid-stream: D aborts the request at once (not after its 3000
    tokens), P and D pools are full, and the next request is still right."""
    opened = open_stream(pair.router.url, completion_body(prompt_ids(300, 60), 3000))
    assert opened.status == 200
    read_chunks(opened, 3)
    aborted = pair.decode.num_finished("abort")
    opened.close()
    assert_pools_full(*pair.instances, timeout_s=5.0)
    wait_until(lambda: pair.decode.num_finished("abort") > aborted, "D counted the abort")
    body = completion_body(prompt_ids(301, 60), 8)
    assert complete(pair.router.url, body).text == reference(body)


@pytest.mark.parametrize("pair", [PUSH_NIXL, PUSH_TCP], indirect=True, ids=_pair_id)
def test_push_abort_while_write_may_be_in_flight(pair: Pair, reference: Reference):
    """Push: eight clients hang up at staggered times around the ends of their prefills, so
    aborts reach D before, while and after P's WRITE into D's reserved blocks, while eight other
    requests run beside them. Those eight get the aggregated output (no block of theirs was
    one a stale write could still land in); afterwards nothing is pending on either side,
    every pool is full, and the aborted prompts, sent again, give the aggregated output."""
    aborted = [completion_body(prompt_ids(400 + i, 600), 200) for i in range(8)]
    beside = [completion_body(prompt_ids(420 + i, 40 + 30 * i), 20) for i in range(8)]
    with ThreadPoolExecutor(len(beside)) as pool:
        answers = pool.map(lambda body: complete(pair.router.url, body), beside)
        _hang_up_staggered([open_stream(pair.router.url, body) for body in aborted], 0.2)
        assert [a.text for a in answers] == [reference(body) for body in beside]
    assert_pools_full(*pair.instances)
    for proc in pair.instances:
        wait_until(lambda p=proc: not any(p.kv_info()["pending"].values()), f"{proc.name} idle")
    answers = run_all(lambda body: complete(pair.router.url, body), aborted[:2])
    assert [a.text for a in answers] == [reference(body) for body in aborted[:2]]
    assert_pools_full(*pair.instances)


def _hang_up_staggered(streams: list[OpenStream], interval_s: float) -> None:
    started = time.monotonic()
    for i, opened in enumerate(streams):
        time.sleep(max(0.0, started + interval_s * i - time.monotonic()))
        opened.close()


# ---- push: registration before and after prefill ends ----------------------------------------


@pytest.mark.parametrize("pair", [PUSH_NIXL, PUSH_TCP], indirect=True, ids=_pair_id)
def test_push_registration_before_prefill_ends(pair: Pair, reference: Reference):
    """A long prompt prefilled in 32-token chunks: D's registration reaches P first
    (registrations_before_ready +1), and the output is right."""
    body = completion_body(prompt_ids(500, LONG_PROMPT_TOKENS), 6)
    before = pair.prefill.stats()
    answer = complete(pair.router.url, body)
    after = pair.prefill.stats()
    assert answer.status == 200, answer.body
    assert answer.text == reference(body)
    assert after["registrations_before_ready"] == before["registrations_before_ready"] + 1
    assert after["registrations_after_ready"] == before["registrations_after_ready"]
    assert_pools_full(*pair.instances)


@pytest.mark.parametrize("pair", [PUSH_NIXL, PUSH_TCP], indirect=True, ids=_pair_id)
def test_push_registration_after_prefill_ends(pair: Pair, cluster: Cluster, reference: Reference):
    """A decode instance that registers 1 s late (fault register_delay_s=1.0): P finishes first
    and holds its blocks for the late registration (registrations_after_ready +1), output right."""
    late = pair.extras["late"]
    router = cluster.route("router-late", [pair.prefill], [late], mode="push")
    try:
        body = completion_body(prompt_ids(600, 40), 8)
        before = pair.prefill.stats()
        answer = complete(router.url, body)
        after = pair.prefill.stats()
        assert answer.status == 200, answer.body
        assert answer.text == reference(body)
        assert after["registrations_after_ready"] == before["registrations_after_ready"] + 1
        assert after["registrations_before_ready"] == before["registrations_before_ready"]
        assert_pools_full(pair.prefill, late)
    finally:
        cluster.stop(router)


@pytest.mark.parametrize("pair", [PULL_NIXL, PUSH_NIXL], indirect=True, ids=_pair_id)
def test_local_prefill_when_decode_lacks_little(pair: Pair, cluster: Cluster, reference: Reference):
    """kv_aware with --local-prefill-tokens 40: a turn whose prompt D's cache lacks at most 40
    tokens of goes to D whole (D prefills them itself: no bytes move, its breakdown counts the
    tokens it computed), longer ones go through P; all right, the router counts each."""
    router = cluster.route("router-local-prefill", [pair.prefill], [pair.decode],
                           mode=pair.connector, policy="kv_aware",
                           args=["--local-prefill-tokens", "40"])  # fmt: skip
    try:
        base = prompt_ids(800, 70)  # more than 40 uncached: P; D will cache 4 full blocks
        body = completion_body(base, 4)
        first = complete(router.url, body)
        assert first.text == reference(body) and first.body["disagg"]["breakdown"]["num_bytes"] > 0
        tries = iter(range(801, 900))

        def goes_local() -> bool:  # once the router's index has followed D's cache
            # A new 20-token turn each try (D lacks 90 - 64 = 26 tokens of it): a try that
            # went through P leaves its own blocks cached on D, which would shrink the next.
            short = completion_body(base + prompt_ids(next(tries), 20), 6)
            answer = complete(router.url, short)
            assert answer.status == 200 and answer.text == reference(short), answer.body
            breakdown = answer.body["disagg"]["breakdown"]
            return "num_bytes" not in breakdown and breakdown["num_prefilled_tokens"] == 26

        wait_until(goes_local, "a short uncached part prefilled on D", timeout_s=10.0)
        long = completion_body(base + prompt_ids(950, 200), 6)
        answer = complete(router.url, long)
        assert answer.text == reference(long) and answer.body["disagg"]["breakdown"]["num_bytes"]
        assert _router_count(router, "local_prefill") >= 1
        assert _router_count(router, "remote_prefill") >= 2
        assert_pools_full(*pair.instances)
    finally:
        cluster.stop(router)


def _router_count(router: Proc, where: str) -> float:
    status, raw = http_request(router.url, "GET", "/metrics", None, timeout_s=5.0)
    assert status == 200
    line = f'disagg_router_prefill_placement_total{{where="{where}"}} '
    found = [row for row in raw.decode().splitlines() if row.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


# ---- late binding: least_loaded ---------------------------------------------------------------


@pytest.mark.parametrize("pair", [PULL_NIXL], indirect=True, ids=_pair_id)
def test_least_loaded_avoids_busy_decode(pair: Pair, cluster: Cluster, reference: Reference):
    """Pull + least_loaded with two decode instances, one busy with four long streams sent to
    it directly: three routed requests all land on the idle one (its transfers +3, the busy
    one's +0) and are right; after the busy streams hang up every pool is full."""
    busy, idle = pair.decode, pair.extras["idle"]
    router = cluster.route(
        "router-least-loaded", [pair.prefill], [busy, idle], mode="pull", policy="least_loaded"
    )
    streams = [
        open_stream(busy.url, completion_body(prompt_ids(700 + i, 20), 3000)) for i in range(4)
    ]
    try:
        for opened in streams:
            read_chunks(opened, 1)
        wait_until(lambda: busy.load()["num_running"] == 4, "busy decode runs its four streams")
        before = {d.name: d.stats()["transfers"] for d in (busy, idle)}
        for i in range(3):
            body = completion_body(prompt_ids(710 + i, 50), 8)
            assert complete(router.url, body).text == reference(body)
        after = {d.name: d.stats()["transfers"] for d in (busy, idle)}
        assert after[idle.name] == before[idle.name] + 3, (before, after)
        assert after[busy.name] == before[busy.name], (before, after)
    finally:
        for opened in streams:
            opened.close()
        assert_pools_full(pair.prefill, busy, idle)
        cluster.stop(router)


# ---- incompatible peers ------------------------------------------------------------------------


@pytest.mark.parametrize("pair", [PULL_NIXL], indirect=True, ids=_pair_id)
@pytest.mark.parametrize("field", ["model", "block_size", "dtype"])
def test_incompatible_decode_is_refused_at_handshake(pair: Pair, cluster: Cluster, field: str):
    """A decode instance with another model (3 layers, not 2), another block size (32, not
    16) or another dtype (bf16 KV, not fp32): P refuses its handshake (handshakes_refused +1),
    the client's error names the field, and no block is held anywhere."""
    decode = pair.extras[field]
    router = cluster.route(f"router-other-{field}", [pair.prefill], [decode], mode="pull")
    try:
        before = pair.prefill.stats()["handshakes_refused"]
        answer = complete(router.url, completion_body(prompt_ids(800, 40), 8), timeout_s=30)
        assert answer.status >= 400, answer.body
        assert f"{field} differs" in answer.error_message, answer.error_message
        assert pair.prefill.stats()["handshakes_refused"] == before + 1
        assert_pools_full(pair.prefill, decode)
    finally:
        cluster.stop(router)


# ---- bf16 end to end -------------------------------------------------------------------------


def test_bf16_pair_moves_bf16_kv_and_matches_bf16_aggregated(cluster: Cluster):
    """P, D and an aggregated instance all in bf16, pull over NIXL: the instances say bf16 on
    /v1/models and /kv_info, the handoff moves half the fp32 bytes, and one request's text is
    the bf16 aggregated text token for token (same prompt, same batch shapes on both paths,
    so the same kernels round the same way)."""
    common = {"connector": "pull", "transport": "nixl", "dtype": "bfloat16"}
    prefill = cluster.serve("prefill-bf16", role="prefill", **common)
    decode = cluster.serve("decode-bf16-pair", role="decode", **common)
    aggregated = cluster.serve("aggregated-bf16", dtype="bfloat16")
    cluster.wait_ready(prefill, decode, aggregated)
    router = cluster.route("router-bf16", [prefill], [decode], mode="pull")
    try:
        for proc in (prefill, decode, aggregated):
            assert proc.get_json("/v1/models")["data"][0]["dtype"] == "bfloat16"
        assert decode.kv_info()["compat"]["dtype"] == "bfloat16"
        body = completion_body(prompt_ids(5, 40), 12)
        answer = complete(router.url, body)
        assert answer.status == 200, answer.body
        assert answer.text == complete(aggregated.url, body).text
        assert decode.stats()["transfers"] == 1
        bf16_bytes = answer.body["disagg"]["breakdown"]["num_bytes"]
        # 40 prompt tokens in 16-token blocks: 3 blocks of 2 layers x k|v x 2 heads x 16 x D.
        spec_bytes = 3 * 2 * 2 * 2 * 16 * (64 // 4) * 2
        assert bf16_bytes == spec_bytes, (bf16_bytes, spec_bytes)
        assert_pools_full(prefill, decode, aggregated)
    finally:
        cluster.stop(router, prefill, decode, aggregated)
