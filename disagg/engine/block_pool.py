"""Paged KV blocks: reference counts, an LRU of free blocks, and prefix caching by block hash.

Pure Python (block ids and token ids only). A block whose ref count drops to zero stays
cached (its hash still maps to it) until allocation needs it: free-but-cached blocks count as
free. Eviction takes the least recently freed block first.

    free queue (OrderedDict, oldest first):  [unhashed ... | cached, oldest freed ... newest]
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections import OrderedDict
from typing import Protocol

__all__ = ["BlockHash", "BlockPool", "hash_blocks"]


BlockHash = bytes  # a SHA-256 digest


def hash_blocks(
    parent_hash: BlockHash | None, token_ids: list[int], block_size: int
) -> list[BlockHash]:
    """SHA-256 digest of every full block of `token_ids`, each chained to its parent's digest
    (`parent_hash` for the first), so equal blocks at different positions (or after different
    prefixes) get different keys. Cryptographic on purpose: Python's hash() of ints is
    predictable, so a client could craft a prompt whose blocks collide with another client's
    and be served (or poison) their KV. Ids are hashed as fixed-width int64 (no ambiguous
    joins), converted to bytes once for all blocks: per-block conversion was most of the cost
    of hashing a 16k-token prompt."""
    raw = array.array("q", token_ids).tobytes()
    step, sha256, digest = block_size * 8, hashlib.sha256, parent_hash or b""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) // block_size * step, step):
        digest = sha256(digest + raw[start : start + step]).digest()
        hashes.append(digest)
    return hashes


class CacheEvents(Protocol):
    """Where the pool reports what its prefix cache gains and loses (engine/kv_events.py)."""

    def stored(self, block_hashes: list[BlockHash]) -> None: ...

    def removed(self, block_hashes: list[BlockHash]) -> None: ...


class BlockPool:
    def __init__(
        self, num_blocks: int, *, enable_caching: bool = True, events: CacheEvents | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}  # block id -> hash (cached blocks only)
        self._block_of: dict[BlockHash, int] = {}  # hash -> block id
        self.num_cache_hits = 0  # blocks served from the cache since start (metrics)
        self.events = events  # None: nobody follows this pool's cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks (ref count 1), evicting cached ones oldest first."""
        assert self.can_allocate(num_blocks), f"allocate({num_blocks}) with {len(self._free)} free"
        # Whole-list operations, not a loop of calls per block: a 16k-token prompt takes 1,024
        # blocks here, and this (with cache_blocks) was a quarter of the simulator's time.
        free, hash_of, block_of, refs = self._free, self._hash_of, self._block_of, self._ref_counts
        block_ids = list(itertools.islice(free, num_blocks))  # the oldest free blocks
        for block_id in block_ids:
            del free[block_id]
            refs[block_id] = 1
        evicted = [h for b in block_ids if (h := hash_of.pop(b, None)) is not None]
        for block_hash in evicted:
            del block_of[block_hash]
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks in order: they are
        queued tail first, so the end of a sequence is evicted before its shared prefix."""
        refs, free, hash_of = self._ref_counts, self._free, self._hash_of
        for block_id in reversed(block_ids):
            count = refs[block_id]
            assert count > 0, f"free of block {block_id} with ref count {count}"
            refs[block_id] = count - 1
            if count == 1:
                free[block_id] = None
                if block_id not in hash_of:
                    free.move_to_end(block_id, last=False)  # reuse uncached ones first

    def lookup(self, block_hashes: list[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes` (not referenced yet)."""
        if not self.enable_caching:
            return []
        hits = []
        for block_hash in block_hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: list[int]) -> None:
        """Reference cached blocks found by lookup() (taking them off the free queue)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        self.num_cache_hits += len(block_ids)

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Publish a full, computed block under its hash (first writer wins)."""
        self.cache_blocks([block_id], [block_hash])

    def cache_blocks(self, block_ids: list[int], block_hashes: list[BlockHash]) -> None:
        """`cache` for each (block, hash) pair, in one call: a prompt publishes its blocks
        together, and per-block calls were a large share of a long prompt's bookkeeping."""
        if not self.enable_caching:
            return
        hash_of, block_of = self._hash_of, self._block_of
        # The caller's blocks are its own (referenced); one C-level scan, not a generator.
        assert 0 not in map(self._ref_counts.__getitem__, block_ids), "caching a free block"
        # Built from the pairs reversed, so of two blocks under one hash the first is kept.
        if hash_of.keys().isdisjoint(block_ids) and block_of.keys().isdisjoint(block_hashes):
            # The common case, a new prompt's blocks: checked and built in C (a 16k-token
            # prompt publishes 1,024 at once, on prefill and decode alike).
            published = dict(zip(reversed(block_hashes), reversed(block_ids), strict=True))
        else:
            published = {
                block_hash: block_id
                for block_id, block_hash in reversed(
                    list(zip(block_ids, block_hashes, strict=True))
                )
                if block_id not in hash_of and block_hash not in block_of
            }
        block_of.update(published)
        hash_of.update(zip(published.values(), published.keys(), strict=True))
        if published and self.events is not None:
            self.events.stored(list(published))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_integrity(self) -> None:
        """Raise with the disagreeing numbers if the books do not balance."""
        free_ids = set(self._free)
        zero_ids = {b for b, c in enumerate(self._ref_counts) if c == 0}
        if free_ids != zero_ids:
            raise AssertionError(
                f"free queue {len(free_ids)} blocks != ref-count-zero {len(zero_ids)} blocks; "
                f"only in queue: {sorted(free_ids - zero_ids)[:8]}, "
                f"only zero: {sorted(zero_ids - free_ids)[:8]}"
            )
        if any(c < 0 for c in self._ref_counts):
            raise AssertionError(f"negative ref counts: {[c for c in self._ref_counts if c < 0]}")
        if len(self._hash_of) != len(self._block_of) or any(
            self._block_of.get(h) != b for b, h in self._hash_of.items()
        ):
            raise AssertionError(
                f"hash maps disagree: {len(self._hash_of)} blocks vs {len(self._block_of)} hashes"
            )
