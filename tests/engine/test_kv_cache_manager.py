"""KVCacheManager over a real BlockPool: which blocks a request holds, and what comes back."""

from __future__ import annotations

from disagg.engine.block_pool import BlockPool
from disagg.engine.kv_cache_manager import KVCacheManager
from tests.fakes import make_request

BS = 4


def test_grow_allocates_only_the_blocks_new_tokens_need() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    request = make_request(10)
    assert kv.can_grow(request, 10)
    kv.grow(request, 10)  # 10 tokens -> 3 blocks
    assert len(request.block_ids) == 3
    request.num_computed_tokens = 10
    kv.grow(request, 2)  # 12 tokens still fit in 3 blocks
    assert len(request.block_ids) == 3
    assert not kv.can_grow(request, 4 * 6)  # 34 tokens would need 9 blocks in all
    kv.free(request)
    assert request.block_ids == [] and pool.num_free_blocks == 8


def test_cached_full_blocks_are_reused_by_a_prompt_with_the_same_prefix() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    first = make_request(prompt=prompt)
    kv.match_prefix(first)
    assert first.num_computed_tokens == 0  # nothing cached yet
    kv.grow(first, 10)
    first.num_computed_tokens = 10
    kv.cache_full_blocks(first)
    assert len(first.block_hashes) == 2

    second = make_request(prompt=prompt[:8] + [99, 98, 97])
    kv.match_prefix(second)
    assert second.block_ids == first.block_ids[:2]
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    kv.reset(second)
    assert second.num_computed_tokens == 0 and second.block_ids == []
    kv.free(first)
    assert pool.num_free_blocks == 16  # cached but unreferenced counts as free
    pool.check_integrity()


def test_match_prefix_leaves_the_last_token_to_compute() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(1, 9))  # exactly 2 blocks
    first = make_request(prompt=prompt)
    kv.grow(first, 8)
    first.num_computed_tokens = 8
    kv.cache_full_blocks(first)
    again = make_request(prompt=prompt)
    kv.match_prefix(again)
    assert again.num_computed_tokens == 4  # the second block is recomputed so it can sample


def test_allocate_for_prompt_reserves_prompt_plus_first_token_or_nothing() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    fits = make_request(11)  # 11 + 1 tokens -> 3 blocks
    assert kv.allocate_for_prompt(fits) and len(fits.block_ids) == 3
    too_big = make_request(8)  # needs 3, 1 left
    assert not kv.allocate_for_prompt(too_big) and too_big.block_ids == []
    assert pool.num_free_blocks == 1
