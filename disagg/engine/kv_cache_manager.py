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
        request.block_ids.extend(self.block_pool.allocate(self._blocks_to_grow(request, num_new)))

    def allocate_for_prompt(self, request: Request) -> bool:
        """Decode side of a disaggregated request: blocks for the whole prompt plus the first
        token, all at once (the KV arrives from elsewhere). False when the pool is short."""
        num_blocks = cdiv(request.num_prompt_tokens + 1, self.block_size)
        if not self.block_pool.can_allocate(num_blocks):
            return False
        request.block_ids = self.block_pool.allocate(num_blocks)
        return True

    def match_prefix(self, request: Request) -> None:
        """Reuse cached blocks of the prompt's prefix; at least one token is left to compute
        so the step that reaches the end can sample."""
        bs = self.block_size
        hashes = self._chain_hashes(request, (request.num_tokens - 1) // bs)
        hits = self.block_pool.lookup(hashes)
        self.block_pool.touch(hits)
        request.block_ids = list(hits)
        request.block_hashes = hashes[: len(hits)]
        request.num_computed_tokens = len(hits) * bs
        request.num_cached_tokens = max(request.num_cached_tokens, len(hits) * bs)

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens match_prefix would reuse now (nothing is referenced): an estimate for
        the load a router reads, which an eviction before the request starts can undo. 0
        without hashing when no match will be made: caching off, or a decode-side request
        whose KV comes from a prefill instance (never matched here)."""
        if request.needs_remote_kv or not self.block_pool.enable_caching:
            return 0
        hashes = self._chain_hashes(request, (request.num_tokens - 1) // self.block_size)
        return len(self.block_pool.lookup(hashes)) * self.block_size

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

    def _chain_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The first `num_blocks` chain digests of the request's tokens, extending its memo."""
        chain, bs = request.chain_hashes, self.block_size
        if len(chain) < num_blocks:
            parent = chain[-1] if chain else None
            chain += hash_blocks(parent, request.token_slice(len(chain) * bs, num_blocks * bs), bs)
        return chain[:num_blocks]
