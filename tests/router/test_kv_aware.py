"""kv_aware in the pool: the request's prompt hashed as the instances hash it, matched against
the router's index of their caches, and the choice going where the prefix is; and the prompt
ids the router derives from a request (token ids as they are, text through the tokenizer)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from disagg.config import RouterConfig
from disagg.engine.block_pool import hash_blocks
from disagg.engine.kv_events import wire_digest
from disagg.router.instances import InstancePool
from disagg.router.policy import Load
from disagg.router.prompt_ids import prompt_token_ids
from disagg.server.tokenizer import Tokenizer
from tests.server.fakes import make_tokenizer_dir

TOKEN = "kv-aware-tests-cluster-token-0123456789"
A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"
IDLE = Load(num_running=0, num_waiting=0, num_free_blocks=64, num_total_blocks=64,
            num_queued_prefill_tokens=0)  # fmt: skip


def _pool(policy: str = "kv_aware") -> InstancePool:
    cfg = RouterConfig(decode_urls=(A, B), cluster_token=TOKEN, policy=policy)
    pool = InstancePool(cfg)
    for inst in pool.instances:
        inst.is_healthy, inst.load = True, IDLE
    return pool


def _holds(pool: InstancePool, url: str, prompt: list[int], block_size: int = 16) -> None:
    digests = [wire_digest(h) for h in hash_blocks(None, prompt, block_size)]
    assert pool.kv_index is not None
    pool.kv_index.apply(url, {"epoch": "e", "seq": 1, "block_size": block_size,
                              "snapshot": digests})  # fmt: skip


def test_a_conversation_goes_where_its_history_is_cached() -> None:
    pool = _pool()
    history = list(range(1000, 1400))  # 25 blocks of 16
    _holds(pool, B, history)
    _holds(pool, A, list(range(5000, 5100)))  # other prompts
    turn = history + list(range(7000, 7040))
    assert [pool.pick("decode", turn).url for _ in range(3)] == [B, B, B]
    assert pool.pick("decode", list(range(9000, 9400))).url == A  # nothing cached: by load
    # B took 3 (pending), A 1: without a prompt, load alone decides
    assert pool.pick("decode").url == A


def test_digests_follow_each_instances_block_size() -> None:
    pool = _pool()
    prompt = list(range(2000, 2256))
    _holds(pool, A, prompt, block_size=32)  # A's digests are of 32-token blocks
    _holds(pool, B, prompt[:64], block_size=16)
    assert pool.pick("decode", prompt).url == A  # 256 cached on A, 64 on B


def test_the_index_is_on_only_for_kv_aware_or_when_asked() -> None:
    assert _pool("least_loaded").kv_index is None
    assert _pool().kv_index is not None and _pool().uses_load


def test_prompt_ids_from_token_ids_text_and_chat(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(make_tokenizer_dir(tmp_path))

    async def ids(body: dict[str, object], path: str, tok: Tokenizer | None) -> object:
        return await prompt_token_ids(body, path, tok)

    assert asyncio.run(ids({"prompt": [5, 6, 7]}, "/v1/completions", None)) == [5, 6, 7]
    assert asyncio.run(ids({"prompt": "hello world"}, "/v1/completions", None)) is None
    text = asyncio.run(ids({"prompt": "hello world"}, "/v1/completions", tokenizer))
    assert text == tokenizer.encode("hello world")
    messages = [{"role": "user", "content": "hello"}]
    chat = asyncio.run(ids({"messages": messages}, "/v1/chat/completions", tokenizer))
    rendered = tokenizer.apply_chat_template(messages, True)
    assert chat == tokenizer.encode(rendered, add_special_tokens=False)
    assert asyncio.run(ids({"messages": "nope"}, "/v1/chat/completions", tokenizer)) is None


def test_pd_decode_pool_weighs_its_cache_and_reports_the_fewest_uncached() -> None:
    """P/D: a decode instance reuses its own cache, so the decode pick goes where the history
    is; uncached_at_next_decode_pick (conditional disaggregation's input) is that one's gap,
    asked without changing what the pick will be."""
    cfg = RouterConfig(mode="pull", prefill_urls=("http://127.0.0.1:9000",), decode_urls=(A, B),
                       cluster_token=TOKEN, policy="kv_aware")  # fmt: skip
    pool = InstancePool(cfg)
    for inst in pool.instances:
        inst.is_healthy, inst.load = True, IDLE
    history = list(range(3000, 3320))  # 20 blocks of 16
    _holds(pool, B, history)
    turn = history + list(range(8000, 8030))
    assert pool.uncached_at_next_decode_pick(turn) == 30
    assert pool.pick("decode", turn).url == B
    fresh = list(range(9000, 9100))  # nothing cached: A by load (B has one pending)
    assert pool.uncached_at_next_decode_pick(fresh) == 100
    assert [pool.pick("decode", fresh).url for _ in range(2)] == [A, A]
    # A tie rotates between A and B with each pick; three peeks between two picks take no
    # turn (had they, the second pick would repeat the first).
    picks = []
    for _ in range(2):
        pool.decode[0].num_pending = pool.decode[1].num_pending = 0
        picks.append(pool.pick("decode", fresh).url)
        pool.decode[0].num_pending = pool.decode[1].num_pending = 0
        assert [pool.uncached_at_next_decode_pick(fresh) for _ in range(3)] == [100] * 3
    assert sorted(picks) == [A, B]
