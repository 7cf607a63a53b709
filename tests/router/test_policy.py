"""Policies on plain records: no servers, no clocks."""

from __future__ import annotations

import dataclasses

import pytest

from disagg.router.policy import (
    InstanceView,
    KVAwarePolicy,
    LeastLoadedPolicy,
    Load,
    NoHealthyInstanceError,
    RoundRobinPolicy,
    load_key,
    make_policy,
)


def make_load(**counts: int) -> Load:
    base = {"num_running": 0, "num_waiting": 0, "num_free_blocks": 100, "num_total_blocks": 100}
    return Load(**{**base, "num_queued_prefill_tokens": 0, **counts})


def view(name: str, role: str = "decode", healthy: bool = True, pending: int = 0, **load: int):
    snapshot = make_load(**load) if load else None
    return InstanceView(url=name, role=role, is_healthy=healthy, load=snapshot, num_pending=pending)  # type: ignore[arg-type]


def test_round_robin_cycles_over_healthy_only() -> None:
    policy = RoundRobinPolicy()
    views = [view("a"), view("b", healthy=False), view("c")]
    assert [views[policy.choose(views)].url for _ in range(4)] == ["a", "c", "a", "c"]


@pytest.mark.parametrize("policy", [RoundRobinPolicy(), LeastLoadedPolicy()])
def test_no_healthy_instance_raises(policy) -> None:
    with pytest.raises(NoHealthyInstanceError, match="decode"):
        policy.choose([view("a", healthy=False, num_running=0)])
    with pytest.raises(NoHealthyInstanceError):
        policy.choose([])


def test_least_loaded_decode_counts_running_plus_waiting_then_free_blocks() -> None:
    policy = LeastLoadedPolicy()
    busy = view("busy", num_running=3, num_waiting=2)
    light = view("light", num_running=4, num_waiting=0)
    assert policy.choose([busy, light]) == 1
    tight = view("tight", num_running=1, num_free_blocks=5)
    roomy = view("roomy", num_running=1, num_free_blocks=50)
    assert policy.choose([tight, roomy]) == 1


def test_least_loaded_never_picks_unhealthy_even_if_idle() -> None:
    idle_but_down = view("down", healthy=False, num_running=0)
    loaded = view("up", num_running=9, num_waiting=9)
    assert LeastLoadedPolicy().choose([idle_but_down, loaded]) == 1


def test_least_loaded_prefill_queued_tokens_dominate_waiting() -> None:
    policy = LeastLoadedPolicy()
    many_short = view("short", role="prefill", num_queued_prefill_tokens=100, num_waiting=5)
    one_long = view("long", role="prefill", num_queued_prefill_tokens=4000, num_waiting=1)
    assert policy.choose([one_long, many_short]) == 1
    same_tokens = [
        view("a", role="prefill", num_queued_prefill_tokens=10, num_waiting=3),
        view("b", role="prefill", num_queued_prefill_tokens=10, num_waiting=1),
    ]
    assert policy.choose(same_tokens) == 1


def test_pending_requests_spread_a_burst_between_polls() -> None:
    policy = LeastLoadedPolicy()
    a = view("a", num_running=1, pending=3)  # looked idle, but we just sent it 3
    b = view("b", num_running=2)
    assert policy.choose([a, b]) == 1


def test_instance_without_load_sorts_after_known_ones() -> None:
    assert load_key(view("new")) > load_key(view("old", num_running=50))
    assert LeastLoadedPolicy().choose([view("new"), view("old", num_running=50)]) == 1


def test_ties_rotate() -> None:
    policy = LeastLoadedPolicy()
    views = [view("a", num_running=1), view("b", num_running=1), view("c", num_running=7)]
    assert sorted(policy.choose(views) for _ in range(4)) == [0, 0, 1, 1]


def test_aggregated_instances_rank_by_requests_then_queued_prefill() -> None:
    a = view("a", role="both", num_running=1, num_queued_prefill_tokens=900)
    b = view("b", role="both", num_running=1, num_queued_prefill_tokens=10)
    assert LeastLoadedPolicy().choose([a, b]) == 1


def test_load_from_dict_validates() -> None:
    raw = {"num_running": 1, "num_waiting": 2, "num_free_blocks": 3, "num_total_blocks": 4}
    assert Load.from_dict({**raw, "num_queued_prefill_tokens": 5}).num_queued_prefill_tokens == 5
    with pytest.raises(ValueError, match="num_queued_prefill_tokens"):
        Load.from_dict(raw)
    with pytest.raises(ValueError, match="num_running"):
        Load.from_dict({**raw, "num_running": -1, "num_queued_prefill_tokens": 0})


def test_make_policy() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(make_policy("least_loaded"), LeastLoadedPolicy)
    with pytest.raises(ValueError, match="random"):
        make_policy("random")


def _cached(name: str, prompt: int, cached: int, **load: int) -> InstanceView:
    base = view(name, role="both", **{"num_running": 0, **load})
    return dataclasses.replace(base, num_prompt_tokens=prompt, num_cached_tokens=cached)


def test_kv_aware_goes_where_the_prefix_is_cached_until_the_queue_costs_more() -> None:
    policy = KVAwarePolicy(request_tokens=64)
    warm, cold = _cached("warm", 1000, 900, num_running=2), _cached("cold", 1000, 0)
    assert policy.choose([cold, warm]) == 1  # 100 + 2 x 64 < 1000
    queued = _cached("warm", 1000, 900, num_running=2, num_queued_prefill_tokens=900)
    assert policy.choose([cold, queued]) == 0  # 100 + 900 + 128 > 1000
    assert policy.cost(_cached("x", 10, 50)) == 0  # a cache longer than the prompt costs 0


def test_kv_aware_without_cache_figures_weighs_load_and_rotates_ties() -> None:
    policy = KVAwarePolicy(request_tokens=64)
    a, b = view("a", role="both", num_running=1), view("b", role="both", num_running=1)
    assert [policy.choose([a, b]) for _ in range(4)] == [0, 1, 0, 1]
    unknown = view("unknown", role="both")  # no /load yet: after every known one
    assert policy.choose([unknown, view("busy", role="both", num_running=9)]) == 1
    with pytest.raises(NoHealthyInstanceError):
        policy.choose([view("down", healthy=False, num_running=0)])
    assert isinstance(make_policy("kv_aware", request_tokens=8), KVAwarePolicy)


def test_kv_aware_counts_only_the_uncached_part_of_a_queue_when_told() -> None:
    policy = KVAwarePolicy(request_tokens=0)
    base = make_load(num_queued_prefill_tokens=5000)
    told = dataclasses.replace(base, num_queued_uncached_tokens=300)
    assert policy.cost(InstanceView(url="a", role="both", is_healthy=True, load=told)) == 300
    assert policy.cost(InstanceView(url="b", role="both", is_healthy=True, load=base)) == 5000
    assert Load.from_dict({**_fields(told)}).num_queued_uncached_tokens == 300
    with pytest.raises(ValueError, match="uncached"):
        Load.from_dict({**_fields(base), "num_queued_uncached_tokens": -1})


def _fields(load: Load) -> dict[str, object]:
    return {name: getattr(load, name) for name in load.__dataclass_fields__}
