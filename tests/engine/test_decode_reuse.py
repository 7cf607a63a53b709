"""Decode-side reuse: a decode instance takes the leading prompt blocks it already caches and
receives only the rest. The corruption class partial reuse invites, each case against the
aggregated answer over symbolic KV (tests/engine/pd_harness.py: a slot in the wrong place reads
as garbage and changes the answer), with both pools balanced afterwards.

Each test was seen to fail on a deliberately broken reuse: blocks paired without the offset
(source_blocks ignoring first_block), the receive naming every block or a first_block of 0,
no reference taken on the hits, the fresh blocks allocated before the hits are referenced,
the prompt's last block reused, and the free hits counted as room for fresh blocks."""

from __future__ import annotations

import pytest

from tests.engine.pd_harness import PDPair, aggregated_answer

BS = 4
MODES = ["pull", "push"]
NEW = 98  # a token no answer holds (the harness samples 1..97): a fresh user turn


def _turn(pair: PDPair, prompt: list[int], max_tokens: int, **kw: bool) -> tuple[str, list[int]]:
    d_id = pair.submit(prompt, max_tokens, **kw)
    pair.run()
    return d_id, pair.tokens[d_id]


def _cached_history(pair: PDPair) -> list[int]:
    """Run one 13-token request (3 answer tokens) through the pair; D then caches the full
    blocks of prompt + answer less its last token: the first 12 tokens."""
    prompt = [1 + i for i in range(13)]
    _, answer = _turn(pair, prompt, 3)
    assert answer == aggregated_answer(prompt, 3)
    return prompt + answer


def _assert_right(pair: PDPair, d_id: str, prompt: list[int], max_tokens: int) -> None:
    assert pair.tokens[d_id] == aggregated_answer(prompt, max_tokens), d_id
    assert pair.d.runner.num_garbage_reads == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cut", range(17))
@pytest.mark.parametrize("tail", [1, 2, 4, 5])
def test_partial_hit_at_every_offset(mode: str, cut: int, tail: int):
    """The second prompt shares `cut` tokens with what D caches (block boundaries and mid-block,
    ending at a block boundary or inside one): D reuses exactly the shared full blocks (never
    the prompt's last block), receives the others, and answers as aggregated."""
    pair = PDPair(mode)
    history = _cached_history(pair)
    prompt = history[:cut] + [NEW + i % 2 for i in range(tail)]
    d_id, _ = _turn(pair, prompt, 5)
    _assert_right(pair, d_id, prompt, 5)
    expected = min(min(cut, 12) // BS, (len(prompt) - 1) // BS)
    assert pair.reused_blocks[d_id] == expected
    assert pair.moved_blocks[d_id] == -(-len(prompt) // BS) - expected
    pair.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_conversation_reuses_more_each_turn(mode: str):
    """Each turn = history + the answer D returned + a new user message: from turn 2 on D
    reuses what it decoded, the transfer shrinks to the new part, the answers stay right."""
    pair = PDPair(mode)
    history = [1 + i % 50 for i in range(10)]
    for turn in range(5):
        d_id, answer = _turn(pair, history, 4)
        _assert_right(pair, d_id, history, 4)
        if turn:
            assert pair.reused_blocks[d_id] >= (len(history) - 8) // BS
            assert pair.moved_blocks[d_id] <= 3
        history = history + answer + [NEW, NEW + 1, NEW, 1 + turn]
    pair.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_hit_evicted_before_allocation(mode: str):
    """D cached the history, then another request took its blocks (the router's index still
    thought them there): D reuses what is left, receives the rest, answers right."""
    pair = PDPair(mode, decode_blocks=12)
    history = _cached_history(pair)
    filler = [40 + i % 9 for i in range(38)]  # 10 blocks with its first token: evicts some
    d_fill, _ = _turn(pair, filler, 1)
    _assert_right(pair, d_fill, filler, 1)
    prompt = history[:12] + [NEW, NEW + 1, NEW]
    d_id, _ = _turn(pair, prompt, 4)
    _assert_right(pair, d_id, prompt, 4)
    assert pair.reused_blocks[d_id] < 3  # not all of it survived
    filler2 = [30 + i % 7 for i in range(46)]  # every block: nothing cached survives
    _turn(pair, filler2, 1)
    d_id, _ = _turn(pair, prompt, 4)
    _assert_right(pair, d_id, prompt, 4)
    assert pair.reused_blocks[d_id] == 0
    pair.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_requests_sharing_a_prefix(mode: str):
    """Two requests with one prompt land on D together: the second must not reuse the first's
    blocks while their KV is still arriving (they are not cached until it lands). Once landed,
    a third reuses them, and a fourth reuses the prompt blocks of a request still decoding."""
    pair = PDPair(mode)
    prompt = [3 + i % 40 for i in range(18)]
    first = pair.submit(prompt, 4, hold=True)
    second = pair.submit(prompt, 4, hold=True)
    for _ in range(4):
        pair.step()
    pair.release(first)
    pair.release(second)
    pair.run()
    for d_id in (first, second):
        _assert_right(pair, d_id, prompt, 4)
        assert pair.reused_blocks[d_id] == 0
    long_running = pair.submit(prompt + [NEW], 40)
    for _ in range(8):  # its KV lands and it decodes; its prompt blocks are cached and held
        pair.step()
    assert pair.d.sched.running, "the long request should still be decoding"
    beside = prompt + [NEW, NEW + 1, 5]
    d_id = pair.submit(beside, 4)
    pair.run()
    _assert_right(pair, long_running, prompt + [NEW], 40)
    _assert_right(pair, d_id, beside, 4)
    assert pair.reused_blocks[long_running] == 4 and pair.reused_blocks[d_id] == 4
    pair.assert_idle()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recompute", [False, True])
def test_partial_hit_then_failed_transfer(mode: str, recompute: bool):
    """A partial hit whose transfer fails: under `fail` the client gets the error, under
    `recompute` D prefills locally and answers as aggregated; either way the reused blocks
    go back to the cache with their references balanced, and a later turn still reuses them."""
    pair = PDPair(mode, recompute=recompute)
    history = _cached_history(pair)
    prompt = history[:14] + [NEW, NEW + 1]
    d_id, _ = _turn(pair, prompt, 4, fail=True)
    if recompute:
        _assert_right(pair, d_id, prompt, 4)
    else:
        assert "injected" in pair.errors[d_id]
    pair.check()
    again = history[:14] + [NEW + 1, NEW]
    d_again, _ = _turn(pair, again, 4)
    _assert_right(pair, d_again, again, 4)
    assert pair.reused_blocks[d_again] == 3
    pair.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_reused_block_still_being_read_by_another_transfer(mode: str):
    """On P, the second request's prefill reuses the first's prompt blocks while the first's
    transfer still reads them (held); on D, the second request reuses nothing of the first
    (its KV has not landed). The first lands after the second finished: both answers right,
    every block back."""
    pair = PDPair(mode)
    prompt = [7 + i % 30 for i in range(21)]
    first = pair.submit(prompt, 3, hold=True)
    for _ in range(3):
        pair.step()
    second_prompt = prompt[:16] + [NEW, NEW + 1]
    second = pair.submit(second_prompt, 3)
    for _ in range(12):
        pair.step()
    assert pair.tokens[second] == aggregated_answer(second_prompt, 3)
    assert pair.p.sched.block_pool.num_cache_hits >= 4  # P reused the leased blocks
    pair.release(first)
    pair.run()
    _assert_right(pair, first, prompt, 3)
    pair.assert_idle()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [8, 12])
def test_whole_prompt_cached_still_moves_its_last_block(mode: str, length: int):
    """Every block of the prompt is cached on D: the last one is received anyway (P's first
    token and the end of the handoff travel with it), the ones before are reused."""
    pair = PDPair(mode)
    history = _cached_history(pair)
    d_id, _ = _turn(pair, history[:length], 4)
    _assert_right(pair, d_id, history[:length], 4)
    assert pair.reused_blocks[d_id] == length // BS - 1
    assert pair.moved_blocks[d_id] == 1
    pair.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_short_pool_counts_the_free_hits_it_takes(mode: str):
    """Cached hits that no request references sit among the free blocks: a reservation that
    fits only by counting them twice waits (it must not take them and then find too few
    blocks), and starts once the pool has room."""
    pair = PDPair(mode, decode_blocks=12)
    history = _cached_history(pair)  # 3 cached blocks, unreferenced
    holder = pair.submit([60 + i % 30 for i in range(24)], 4, hold=True)  # 7 blocks held
    for _ in range(3):
        pair.step()
    assert holder in pair.d.sched.waiting_for_kv
    prompt = history[:12] + [NEW + i % 2 for i in range(9)]  # 6 blocks: 3 hits + 3 fresh
    d_id = pair.submit(prompt, 4)
    for _ in range(4):
        pair.step()
    assert d_id not in pair.d.sched.waiting_for_kv  # 5 free, 3 of them its own hits: waits
    pair.check()
    pair.release(holder)
    pair.run()
    _assert_right(pair, holder, [60 + i % 30 for i in range(24)], 4)
    _assert_right(pair, d_id, prompt, 4)
    pair.assert_idle()
