"""Which KV blocks a request holds: grow it for new tokens, reuse cached blocks of its prefix,
cache its full blocks by their hash chain, give them back.

Pure Python, between the scheduler (which decides *when*) and the block pool (which owns ref
counts and the hash -> block map): block ids and token counts only.
"""

from __future__ import annotations

from disagg.engine.block_pool import BlockHash, BlockPool, hash_blocks
from disagg.engine.request import Request

__all__ = ["KVCacheManager", "cdiv"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size

    def can_grow(self, request: Request, num_new: int) -> bool:
        return self.block_pool.can_allocate(self._blocks_to_grow(request, num_new))

    def grow(self, request: Request, num_new: int) -> None:
        """Give the request blocks for `num_new` more tokens (the caller checked can_grow)."""
        num_blocks = self._blocks_to_grow(request, num_new)
        if num_blocks:  # most decode steps fit in the last block: no pool call at all
            request.block_ids.extend(self.block_pool.allocate(num_blocks))

    def allocate_for_prompt(self, request: Request) -> bool:
        """Decode side of a disaggregated request: blocks for the whole prompt plus the first
        token, all at once. The leading full blocks this pool already caches are reused
        (`request.num_reused_blocks`); the KV of the rest arrives from elsewhere into fresh
        blocks. At least the prompt's last block is always fresh, so every handoff moves some
        KV and ends the way it always does. False (nothing held) when the pool is short."""
        bs = self.block_size
        hits = self._lookup(request, (request.num_prompt_tokens - 1) // bs)
        num_fresh = cdiv(request.num_prompt_tokens + 1, bs) - len(hits)
        # Hits with no reference sit in the free queue: touching them takes them out of it.
        num_idle_hits = sum(1 for b in hits if self.block_pool.ref_count(b) == 0)
        if num_fresh > self.block_pool.num_free_blocks - num_idle_hits:
            return False
        # Touch before allocate: an unreferenced hit is free, and allocate would hand it out
        # (evicted) as a fresh block, the same block then read as cached and written by the
        # transfer.
        self.block_pool.touch(hits)
        request.block_ids = [*hits, *self.block_pool.allocate(num_fresh)]
        request.block_hashes = request.chain_hashes[: len(hits)]
        request.num_reused_blocks = len(hits)
        return True

    def match_prefix(self, request: Request) -> None:
        """Reuse cached blocks of the prompt's prefix; at least one token is left to compute
        so the step that reaches the end can sample."""
        bs = self.block_size
        hits = self._lookup(request, (request.num_tokens - 1) // bs)
        self.block_pool.touch(hits)
        request.block_ids = list(hits)
        request.block_hashes = request.chain_hashes[: len(hits)]
        request.num_computed_tokens = len(hits) * bs
        request.num_cached_tokens = max(request.num_cached_tokens, len(hits) * bs)

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens match_prefix would reuse now (nothing is referenced): an estimate for
        the load a router reads, which an eviction before the request starts can undo. 0
        for a decode-side request whose KV comes from a prefill instance (its reuse is
        counted when it allocates); `_lookup` hashes nothing when caching is off."""
        if request.needs_remote_kv:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        return len(self._lookup(request, max_blocks)) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Publish every newly completed block under its hash, for later prefix matches."""
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_ids))
        first = len(request.block_hashes)
        if num_full <= first:
            return
        new = self._chain_hashes(request, num_full)[first:num_full]
        request.block_hashes.extend(new)
        self.block_pool.cache_blocks(request.block_ids[first:num_full], new)

    def free(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []

    def reset(self, request: Request) -> None:
        """Free the blocks and forget the computed tokens (preemption, or no room to start)."""
        self.free(request)
        request.block_hashes = []
        request.num_computed_tokens = 0

    def _blocks_to_grow(self, request: Request, num_new: int) -> int:
        needed = cdiv(request.num_computed_tokens + num_new, self.block_size)
        return max(0, needed - len(request.block_ids))

    def _lookup(self, request: Request, max_blocks: int) -> list[int]:
        """Cached blocks of the longest prefix of the request's first `max_blocks` full
        blocks (not referenced yet); no hashing when caching is off."""
        if not self.block_pool.enable_caching:
            return []
        return self.block_pool.lookup(self._chain_hashes(request, max_blocks))

    def _chain_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The first `num_blocks` chain digests of the request's tokens, extending its memo."""
        chain, bs = request.chain_hashes, self.block_size
        if len(chain) < num_blocks:
            parent = chain[-1] if chain else None
            chain += hash_blocks(parent, request.token_slice(len(chain) * bs, num_blocks * bs), bs)
        return chain[:num_blocks]
