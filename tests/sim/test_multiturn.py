"""The multi-turn workload in the simulator: conversations built from the answers returned,
placement by the real kv_aware policy over the router's real index, reuse by the real
schedulers (decode-side reuse, prefill on D)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from disagg.bench.workload import WorkloadConfig
from disagg.sim.conversations import make_sim_conversations
from disagg.sim.router import SimRouter
from disagg.sim.sim_config import SimConfig
from tests.sim.helpers import make_config, simulate

_TURNS = 4


def _config(mode: str = "pull", **overrides: Any) -> SimConfig:
    workload = WorkloadConfig(
        dataset="multiturn", num_prompts=6, num_turns=_TURNS, prefix_len=256,
        input_len=48, output_len=16, seed=3,
    )  # fmt: skip
    return replace(make_config(mode, num_decode=2), workload=workload, **overrides)


def _mean(result: dict[str, Any], field: str) -> float:
    return sum(b.get(field, 0.0) for b in result["breakdowns"]) / len(result["breakdowns"])


def test_conversations_share_the_system_prompt_and_differ_after_it() -> None:
    cfg = _config().workload
    a, b = make_sim_conversations(cfg)[:2]
    assert a.history == b.history and len(a.history) == cfg.prefix_len
    assert len(a.user_turns) == _TURNS and all(len(t) == cfg.input_len for t in a.user_turns)
    assert a.user_turns[0] != b.user_turns[0]
    assert make_sim_conversations(cfg)[0].user_turns == a.user_turns  # seeded


def test_each_turn_holds_the_history_and_the_answer_returned(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    sent: dict[str, list[int]] = {}
    submit = SimRouter.submit

    def spy(self: SimRouter, request: Any) -> None:
        sent[request.request_id] = list(request.prompt_token_ids)
        submit(self, request)

    monkeypatch.setattr(SimRouter, "submit", spy)
    cfg = _config()
    result, cluster = simulate(cfg)
    assert result["completed"] == 6 * _TURNS and result["failed"] == 0
    assert sorted(result["turns"]) == sorted(list(range(1, _TURNS + 1)) * 6)
    user_len, answer_len = cfg.workload.input_len, cfg.workload.output_len
    for c in range(6):
        for t in range(2, _TURNS + 1):
            before, now = sent[f"c{c}-t{t - 1}"], sent[f"c{c}-t{t}"]
            assert now[: len(before)] == before  # the history, unchanged
            assert len(now) == len(before) + answer_len + user_len  # + the answer + a turn
            answer = cluster.router.requests[f"c{c}-t{t - 1}"].output_ids
            assert answer is not None and now[len(before) : len(before) + answer_len] == answer


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_kv_aware_with_local_prefill_moves_less_kv_than_least_loaded(mode: str) -> None:
    """The history D decoded stays in D's cache: kv_aware sends the next turn back there, and
    with a short uncached part D prefills it itself. run_simulation checked every pool full."""
    least, _ = simulate(_config(mode, policy="least_loaded"))
    kv, kv_cluster = simulate(_config(mode, policy="kv_aware", local_prefill_tokens=128))
    assert kv["completed"] == least["completed"] == 6 * _TURNS
    assert kv["sim"]["num_local_prefills"] > 0 and least["sim"]["num_local_prefills"] == 0
    assert kv_cluster.router.kv_index is not None and len(kv_cluster.router.kv_index) > 0
    assert _mean(kv, "num_bytes") < 0.6 * _mean(least, "num_bytes")
    # (Whether TTFT gains depends on the hardware: on a GPU profile a remote prefill of the
    # short part can beat D's own, which is why the threshold is a measured flag.)


def test_decode_side_reuse_shows_in_the_simulated_breakdown() -> None:
    """Without local prefill every turn goes through P; D still receives only what it lacks."""
    result, _ = simulate(_config("pull", policy="kv_aware"))
    assert _mean(result, "num_reused_tokens") > 0
    assert result["sim"]["num_local_prefills"] == 0


def test_kv_aware_keeps_aggregated_conversations_where_their_history_is() -> None:
    cfg = replace(_config("aggregated"), num_prefill=2, num_decode=0)
    least, _ = simulate(replace(cfg, policy="least_loaded"))
    kv, _ = simulate(replace(cfg, policy="kv_aware"))
    assert _mean(kv, "num_prefilled_tokens") < _mean(least, "num_prefilled_tokens")
