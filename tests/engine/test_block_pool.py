"""Block pool: allocation, sharing, caching, eviction order, and a randomized invariant run."""

import array
import hashlib
import random

import pytest

from disagg.engine.block_pool import BlockPool, hash_blocks


def test_allocate_free_roundtrip():
    pool = BlockPool(8)
    ids = pool.allocate(5)
    assert len(set(ids)) == 5 and pool.num_free_blocks == 3
    pool.free(ids)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_cached_block_survives_free_and_is_found():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    (h,) = hash_blocks(None, [1, 2, 3, 4], 4)
    pool.cache(block, h)
    pool.free([block])
    assert pool.num_free_blocks == 4  # cached-but-unreferenced counts as free
    assert pool.lookup([h]) == [block]
    pool.touch([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 3
    pool.free([block])
    pool.check_integrity()


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.free([a])
    pool.free([b, c])
    got = pool.allocate(2)
    assert a not in got  # the cached block is evicted last
    assert pool.lookup([111]) == [a]


def test_eviction_drops_the_hash():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.cache(a, 5)
    pool.free([a])
    pool.allocate(1)
    assert pool.lookup([5]) == []
    pool.check_integrity()


def test_hash_chains_on_parent():
    (parent,) = hash_blocks(None, [0], 1)
    assert hash_blocks(None, [1, 2], 2) != hash_blocks(parent, [1, 2], 2)


def test_free_of_free_block_is_an_invariant_error():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids)


def test_randomized_allocate_free_share_evict():
    rng = random.Random(1234)
    pool = BlockPool(64)
    owners: list[list[int]] = []  # each owner holds one reference to each of its blocks
    hashes: dict[int, int] = {}
    for step in range(5000):
        action = rng.random()
        if action < 0.35 and pool.can_allocate(n := rng.randint(1, 6)):
            blocks = pool.allocate(n)
            for b in blocks:
                if rng.random() < 0.5:
                    h = rng.randint(0, 40)  # collisions on purpose: first writer wins
                    pool.cache(b, h)
            owners.append(blocks)
        elif action < 0.55 and owners:
            pool.free(owners.pop(rng.randrange(len(owners))))
        elif action < 0.8:
            hits = pool.lookup([rng.randint(0, 40)])
            if hits:
                pool.touch(hits)
                owners.append(hits)
        elif owners:  # share: a second owner of an existing block list
            blocks = owners[rng.randrange(len(owners))]
            pool.touch(blocks)
            owners.append(list(blocks))
        if step % 97 == 0:
            pool.check_integrity()
            referenced = {b for o in owners for b in o}
            assert pool.num_used_blocks == len(referenced)
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free_blocks == 64
    pool.check_integrity()
    del hashes


def test_hash_blocks_chains_exactly_as_block_by_block_hashing() -> None:
    """The digest's definition, written out: SHA-256(parent digest || the block's int64 ids)."""
    tokens = list(range(1000, 1037))  # 4 full blocks of 8 and a partial one
    expected, parent = [], b""
    for start in range(0, 32, 8):
        block = array.array("q", tokens[start : start + 8]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        expected.append(parent)
    assert hash_blocks(None, tokens, 8) == expected
    assert hash_blocks(expected[1], tokens[16:32], 8) == expected[2:]


def test_cache_blocks_keeps_the_first_writer_of_a_hash_within_one_call() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache_blocks([a, b, c], [b"x", b"x", b"y"])
    assert pool.lookup([b"x", b"y"]) == [a, c]
    pool.free([a, b, c])
    pool.check_integrity()  # b was never published: the two maps still agree
    assert pool.allocate(4)[0] == b  # uncached free blocks are reused first
