"""The multiturn workload: conversations built from the corpus, played turn by turn against a
fake OpenAI server on loopback, each turn carrying the answers the server actually returned."""

from __future__ import annotations

import asyncio

import pytest

from disagg.bench.multiturn import conversation_prompt, make_conversations
from disagg.bench.runner import BenchConfig, run_benchmark
from disagg.bench.workload import WorkloadConfig, make_workload
from tests.bench.fake_server import FakeBehavior, ThreadedServer

WORKLOAD = WorkloadConfig(
    dataset="multiturn", num_prompts=3, num_turns=3, prefix_len=40, input_len=8, output_len=3
)


def test_conversations_share_the_system_prompt_and_are_seeded() -> None:
    conversations = make_conversations(WORKLOAD)
    assert len(conversations) == 3 and all(len(c.user_turns) == 3 for c in conversations)
    assert len({c.system for c in conversations}) == 1  # one shared system prompt
    users = [u for c in conversations for u in c.user_turns]
    assert len(set(users)) == len(users)  # every user turn its own text
    assert make_conversations(WORKLOAD) == conversations
    other_seed = make_conversations(WorkloadConfig(**{**_fields(WORKLOAD), "seed": 1}))
    assert other_seed != conversations


def _fields(w: WorkloadConfig) -> dict[str, object]:
    return {name: getattr(w, name) for name in w.__dataclass_fields__}


def test_a_turn_carries_the_history_and_the_answers_in_order() -> None:
    conv = make_conversations(WORKLOAD)[0]
    messages = conversation_prompt(conv, ["A1", "A2"], 2, is_chat=True)
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "user", "assistant", "user",
    ]  # fmt: skip
    assert [m["content"] for m in messages] == [
        conv.system, conv.user_turns[0], "A1", conv.user_turns[1], "A2", conv.user_turns[2],
    ]  # fmt: skip
    text = conversation_prompt(conv, ["A1", "A2"], 2, is_chat=False)
    assert text == "\n".join(m["content"] for m in messages)
    with pytest.raises(AssertionError):
        conversation_prompt(conv, ["A1"], 2, is_chat=False)  # an answer is missing


def test_the_prompt_list_refuses_conversations() -> None:
    with pytest.raises(ValueError, match="turn by turn"):
        make_workload(WORKLOAD)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_turns_play_in_order_with_the_answers_returned(endpoint: str) -> None:
    behavior = FakeBehavior(tag_answers=True)
    with ThreadedServer(behavior) as server:
        cfg = BenchConfig(base_url=server.base_url, workload=WORKLOAD, endpoint=endpoint)
        result = asyncio.run(run_benchmark(cfg))
    assert (result["completed"], result["failed"]) == (9, 0)
    assert result["num_turns"] == 3 and result["dataset"] == "multiturn"
    assert result["turns"] == [1, 2, 3] * 3  # conversation by conversation
    assert set(result["median_ttft_ms_by_turn"]) == {"1", "2", "3"}
    assert result["median_ttft_ms_later_turns"] > 0
    for conv in make_conversations(WORKLOAD):
        sent = [b for b in behavior.bodies if conv.user_turns[0] in _text(b)]
        assert len(sent) == 3  # every turn repeats the first user message
        for turn, body in enumerate(sent):  # in the order the server received them
            assert conv.user_turns[turn] in _text(body)
            assert _text(body).count("tok0") == turn  # one answer per earlier turn
        # the server's answer to turn 1 (tagged with its request number) is in turn 2's prompt
        first = behavior.bodies.index(sent[0]) + 1
        assert f"r{first}-tok0 r{first}-tok1 r{first}-tok2" in _text(sent[1])


def _text(body: dict[str, object]) -> str:
    if "messages" in body:
        return "\n".join(m["content"] for m in body["messages"])  # type: ignore[union-attr]
    return str(body["prompt"])


def test_a_failed_turn_ends_its_conversation() -> None:
    behavior = FakeBehavior(fail_every=2)  # the 2nd request the server sees fails
    one = WorkloadConfig(**{**_fields(WORKLOAD), "num_prompts": 1})
    with ThreadedServer(behavior) as server:
        result = asyncio.run(run_benchmark(BenchConfig(base_url=server.base_url, workload=one)))
    assert (result["completed"], result["failed"]) == (1, 1)  # turn 3 was never sent
    assert result["turns"] == [1, 2] and len(behavior.bodies) == 2
