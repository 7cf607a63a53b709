"""Routing policies: choose one instance of a role from plain records of health and load.

Pure: no I/O, no clocks, no aiohttp. The app builds `InstanceView`s from live records and
asks a policy for an index; polling and HTTP live in `instances.py` and `legs.py`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "InstanceRole",
    "InstanceView",
    "KVAwarePolicy",
    "LeastLoadedPolicy",
    "Load",
    "NoHealthyInstanceError",
    "Policy",
    "RoundRobinPolicy",
    "make_policy",
    "uncached_at_pick",
]

# "both" = an aggregated instance that prefills and decodes its own requests.
InstanceRole = Literal["prefill", "decode", "both"]

_LOAD_FIELDS = (
    "num_running",
    "num_waiting",
    "num_free_blocks",
    "num_total_blocks",
    "num_queued_prefill_tokens",
)


class NoHealthyInstanceError(RuntimeError):
    """No candidate can take the request; the app answers 503."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """One `/load` snapshot of an instance (counts at the moment it answered)."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued, including those waiting for remote KV
    num_free_blocks: int  # KV blocks free in the pool
    num_total_blocks: int  # KV blocks in the pool
    num_queued_prefill_tokens: int  # prompt tokens not yet prefilled, over all requests
    # The same less what the instance's prefix cache is expected to cover (None: not reported,
    # an instance of an older version: kv_aware then counts every queued token).
    num_queued_uncached_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: Any) -> Load:
        """Parse an instance's `/load` answer; raises ValueError on a missing or bad field."""
        if not isinstance(raw, dict):
            raise ValueError(f"load must be an object, got {type(raw).__name__}")
        values: dict[str, int] = {}
        for name in _LOAD_FIELDS:
            value = raw.get(name)
            if type(value) is not int or value < 0:
                raise ValueError(f"load.{name} must be an integer >= 0, got {value!r}")
            values[name] = value
        uncached = raw.get("num_queued_uncached_tokens")
        if uncached is not None and (type(uncached) is not int or uncached < 0):
            raise ValueError(
                f"load.num_queued_uncached_tokens must be an integer >= 0, got {uncached!r}"
            )
        return cls(**values, num_queued_uncached_tokens=uncached)


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceView:
    """What a policy sees of one instance."""

    url: str
    role: InstanceRole
    is_healthy: bool
    load: Load | None = None  # None until the first /load answer
    num_pending: int = 0  # requests this router sent it since `load` was taken
    # kv_aware: the request's prompt length and how much of it this instance's prefix cache
    # holds, as far as the router's index knows (0 and 0 when it cannot tell).
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class Policy(abc.ABC):
    """Chooses among the candidates of one role. One policy object per role: it may keep state
    (a rotation counter) but never does I/O."""

    @abc.abstractmethod
    def choose(self, candidates: Sequence[InstanceView], *, peek: bool = False) -> int:
        """Index into `candidates` of the chosen instance; unhealthy ones are never chosen.
        Raises NoHealthyInstanceError when none is healthy. `peek`: the choice the next call
        would make, leaving the policy's state (whose turn it is) as it was."""


class RoundRobinPolicy(Policy):
    def __init__(self) -> None:
        self._num_chosen = 0

    def choose(self, candidates: Sequence[InstanceView], *, peek: bool = False) -> int:
        healthy = _healthy_indices(candidates)
        index = healthy[self._num_chosen % len(healthy)]
        self._num_chosen += 0 if peek else 1
        return index


class _LowestKeyPolicy(Policy):
    """The healthy candidate with the lowest `key` wins; ties rotate so equal instances share
    the work."""

    def __init__(self) -> None:
        self._num_ties = 0

    @abc.abstractmethod
    def key(self, view: InstanceView) -> Any:
        """Smaller is better."""

    def choose(self, candidates: Sequence[InstanceView], *, peek: bool = False) -> int:
        healthy = _healthy_indices(candidates)
        keys = {i: self.key(candidates[i]) for i in healthy}
        best = min(keys.values())
        tied = [i for i in healthy if keys[i] == best]
        index = tied[self._num_ties % len(tied)]
        self._num_ties += 0 if peek else 1
        return index


class LeastLoadedPolicy(_LowestKeyPolicy):
    """Lowest load key wins (see `load_key`)."""

    def key(self, view: InstanceView) -> tuple[int, ...]:
        return load_key(view)


class KVAwarePolicy(_LowestKeyPolicy):
    """Lowest cost wins, in prompt tokens: what the instance must still compute for this
    request (its prompt less the prefix the instance holds) plus what it has queued (prompt
    tokens not yet prefilled, less what its own cache is expected to cover: a queued turn's
    history is cached too) plus `request_tokens` for each request already there. So a
    conversation stays where its history is cached until the queue there costs more than
    recomputing it elsewhere. Without a snapshot an instance sorts after all others; ties
    rotate."""

    def __init__(self, request_tokens: int) -> None:
        super().__init__()
        self.request_tokens = request_tokens

    def key(self, view: InstanceView) -> float:
        return self.cost(view)

    def cost(self, view: InstanceView) -> float:
        load = view.load
        if load is None:
            return math.inf
        num_requests = load.num_running + load.num_waiting + view.num_pending
        to_compute = max(0, view.num_prompt_tokens - view.num_cached_tokens)
        queued = load.num_queued_uncached_tokens
        if queued is None:
            queued = load.num_queued_prefill_tokens
        return to_compute + queued + self.request_tokens * num_requests


def load_key(view: InstanceView) -> tuple[int, ...]:
    """Sort key, smaller is less loaded. An instance without a snapshot sorts after all others.

    Prefill: queued prompt tokens dominate (they are the wait before this prompt starts), then
    queued requests. Decode: requests in the batch or queued, then fewer free blocks is worse.
    `num_pending` counts what we sent since the snapshot, so a burst between two polls spreads out
    instead of piling onto the instance that looked idle.
    """
    load = view.load
    if load is None:
        return (1,)
    if view.role == "prefill":
        return (0, load.num_queued_prefill_tokens, load.num_waiting + view.num_pending)
    num_requests = load.num_running + load.num_waiting + view.num_pending
    if view.role == "both":
        return (0, num_requests, load.num_queued_prefill_tokens, -load.num_free_blocks)
    return (0, num_requests, -load.num_free_blocks)


def uncached_at_pick(policy: Policy, views: Sequence[InstanceView]) -> int:
    """Prompt tokens the instance `policy` would pick now lacks (views carrying the prompt's
    cached part): decode-first, the pick is made and then asked. Takes no turn of the ties."""
    view = views[policy.choose(views, peek=True)]  # raises NoHealthyInstanceError if none
    return view.num_prompt_tokens - view.num_cached_tokens


def make_policy(name: str, *, request_tokens: int = 16) -> Policy:
    """A fresh policy object for one role; `name` as in RouterConfig.policy
    (`request_tokens`: kv_aware's weight of a request already on an instance)."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "kv_aware":
        return KVAwarePolicy(request_tokens)
    raise ValueError(f"policy must be round_robin, least_loaded or kv_aware, got {name!r}")


def _healthy_indices(candidates: Sequence[InstanceView]) -> list[int]:
    healthy = [i for i, view in enumerate(candidates) if view.is_healthy]
    if not healthy:
        roles = sorted({view.role for view in candidates}) or ["any"]
        raise NoHealthyInstanceError(f"no healthy {'/'.join(roles)} instance")
    return healthy
