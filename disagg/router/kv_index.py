"""Which instances hold which cached prompt blocks: the router's index of their prefix caches.

Fed by each instance's `GET /kv/events` (engine/kv_events.py): reports of digests stored and
removed, or a snapshot after a gap or a restart. Bounded: past `max_digests` the digest stored
longest ago is forgotten for every instance (the index advises placement; forgetting costs a
prefill, never a wrong answer). Pure: no I/O, no clock; kv_follow.py does the fetching.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from disagg.engine.block_pool import hash_blocks
from disagg.engine.kv_events import wire_digest
from disagg.router.policy import InstanceView

__all__ = ["KV_AWARE_INDEX_BLOCKS", "KVIndex", "with_cached_tokens"]

KV_AWARE_INDEX_BLOCKS = 65536  # digests a router keeps under kv_aware (about 25 MB)

_DIGEST = re.compile(r"[0-9a-f]{16}")  # engine/kv_events.py: 8 bytes, hex
_KINDS = ("stored", "removed")


class KVIndex:
    def __init__(self, max_digests: int) -> None:
        if max_digests <= 0:
            raise ValueError(f"max_digests must be > 0, got {max_digests}")
        self.max_digests = max_digests
        self._where: OrderedDict[str, set[str]] = OrderedDict()  # digest -> instance urls
        self._cursor: dict[str, tuple[str, int]] = {}  # url -> (epoch, seq) last applied
        self._block_size: dict[str, int] = {}  # url -> tokens per block (digests depend on it)

    def __len__(self) -> int:
        return len(self._where)

    def followed(self) -> set[str]:
        """The instances whose reports the index holds."""
        return set(self._cursor)

    def num_held(self) -> dict[str, int]:
        """Cached blocks known per instance (walks the whole index: for views, not routing)."""
        counts: dict[str, int] = dict.fromkeys(self._cursor, 0)
        for urls in self._where.values():
            for url in urls:
                counts[url] = counts.get(url, 0) + 1
        return counts

    def cursor(self, url: str) -> tuple[str, int]:
        """What to ask `url` for next: the reports after the last answer applied."""
        return self._cursor.get(url, ("", 0))

    def apply(self, url: str, answer: Any) -> None:
        """One `/kv/events` answer from `url`. ValueError (nothing applied) if malformed."""
        epoch, seq, block_size, reports = _parse(answer)
        if reports is None:  # a snapshot: everything `url` holds now
            self.forget(url)
            self._store(url, answer["snapshot"])
        else:
            for kind, digests in reports:
                (self._store if kind == "stored" else self._remove)(url, digests)
        self._cursor[url] = (epoch, seq)
        if block_size is not None:
            self._block_size[url] = block_size

    def forget(self, url: str) -> None:
        """`url` holds nothing we know of (it left, restarted, or sent a snapshot)."""
        self._cursor.pop(url, None)
        self._block_size.pop(url, None)
        for digest in [d for d, urls in self._where.items() if url in urls]:
            self._discard(digest, url)

    def num_cached(self, url: str, digests: list[str]) -> int:
        """How many leading blocks of a prompt (its chained digests, in order) `url` holds."""
        n = 0
        for digest in digests:
            if url not in self._where.get(digest, ()):
                break
            n += 1
        return n

    def num_cached_tokens(
        self, url: str, prompt_ids: list[int], digests: dict[int, list[str]]
    ) -> int:
        """Prompt tokens `url` holds as leading full blocks. `digests` memoizes the prompt's
        chained digests per block size over the candidates of one choice."""
        block_size = self._block_size.get(url)
        if block_size is None:
            return 0
        if block_size not in digests:
            hashes = hash_blocks(None, prompt_ids, block_size)
            digests[block_size] = [wire_digest(h) for h in hashes]
        return self.num_cached(url, digests[block_size]) * block_size

    def _store(self, url: str, digests: list[str]) -> None:
        where = self._where
        for digest in digests:
            urls = where.get(digest)
            if urls is None:
                where[digest] = {url}
            else:
                urls.add(url)
                where.move_to_end(digest)
        while len(where) > self.max_digests:
            where.popitem(last=False)

    def _remove(self, url: str, digests: list[str]) -> None:
        for digest in digests:
            self._discard(digest, url)

    def _discard(self, digest: str, url: str) -> None:
        urls = self._where.get(digest)
        if urls is not None:
            urls.discard(url)
            if not urls:
                del self._where[digest]


def with_cached_tokens(
    index: KVIndex, views: Sequence[InstanceView], prompt_ids: list[int]
) -> list[InstanceView]:
    """`views` with the prompt's length and the part of it each instance caches, as the index
    knows it: what kv_aware weighs (the router's pool and the simulator's router alike)."""
    digests: dict[int, list[str]] = {}  # per block size, for every candidate alike
    cached = [index.num_cached_tokens(v.url, prompt_ids, digests) for v in views]
    return [replace(v, num_prompt_tokens=len(prompt_ids), num_cached_tokens=n)
            for v, n in zip(views, cached, strict=True)]  # fmt: skip


_Reports = list[tuple[str, list[str]]]


def _parse(answer: Any) -> tuple[str, int, int | None, _Reports | None]:
    """(epoch, seq, block size if sent, reports), reports None for a snapshot; ValueError on
    anything else."""
    if not isinstance(answer, dict):
        raise ValueError("kv events: not an object")
    epoch, seq, block_size = answer.get("epoch"), answer.get("seq"), answer.get("block_size")
    if not isinstance(epoch, str) or type(seq) is not int or seq < 0:
        raise ValueError("kv events: epoch must be a string and seq an integer >= 0")
    if block_size is not None and (type(block_size) is not int or block_size <= 0):
        raise ValueError("kv events: block_size must be an integer > 0")
    if "snapshot" in answer:
        _check_digests(answer["snapshot"])
        return epoch, seq, block_size, None
    events = answer.get("events")
    if not isinstance(events, list):
        raise ValueError("kv events: neither events nor a snapshot")
    reports = []
    for event in events:
        if not isinstance(event, dict) or event.get("kind") not in _KINDS:
            raise ValueError("kv events: an event must be stored or removed")
        reports.append((event["kind"], _check_digests(event.get("digests"))))
    return epoch, seq, block_size, reports


def _check_digests(digests: Any) -> list[str]:
    if not isinstance(digests, list) or not all(
        isinstance(d, str) and _DIGEST.fullmatch(d) for d in digests
    ):
        raise ValueError("kv events: digests must be 16 lowercase hex characters each")
    return digests
