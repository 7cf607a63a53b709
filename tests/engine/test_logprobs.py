"""Logprobs from the engine: those of greedy tokens equal log_softmax of transformers' fp32
logits (teacher-forced on our tokens), for every row of a batch with chunked prefill; rows
that did not ask get none and cost nothing; a first token relayed from a prefill instance
keeps the logprobs it was sent with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disagg.engine.sampler import Sampler
from disagg.kv.common import KVIdentity
from disagg.kv.pull import PullScheduler
from disagg.protocol import KVTransferParams, SamplingParams, TokenLogprobs
from disagg.server.tokenizer import Tokenizer
from tests import fakes
from tests.engine.test_equivalence import _hf_model, _prompts, assert_pool_full, make_engine

TOLERANCE = 1e-3  # nats; fp32 against fp32, two implementations


def hf_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The oracle: log_softmax of transformers' fp32 logits at each output position, fed our
    own tokens -> [len(tokens), vocab]."""
    model = _hf_model(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def run_with_logprobs(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Add every request, step to the end -> request id -> (tokens, logprobs entries)."""
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(request_id, prompt, sampling)
    got: dict[str, tuple[list[int], list]] = {rid: ([], []) for rid in requests}
    while engine.has_work:
        for out in engine.step():
            tokens, entries = got[out.request_id]
            tokens.extend(out.new_token_ids)
            if out.new_logprobs is None:
                entries.append(None)
            else:
                entries.extend(out.new_logprobs)
    return got


def assert_matches_oracle(model_dir: Path, prompt: list[int], tokens: list[int], entries) -> None:
    oracle = hf_logprobs(model_dir, prompt, tokens)
    assert len(entries) == len(tokens)
    for position, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        expected = oracle[position]
        assert abs(entry.logprob - float(expected[token])) < TOLERANCE, position
        assert token == int(expected.argmax()), position  # greedy: the sampled token is top 1
        want = expected[entry.top_ids]
        assert torch.allclose(torch.tensor(entry.top_logprobs), want, atol=TOLERANCE), position
        assert entry.top_ids[0] == token
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        # The k best, not any k: the k-th we report is >= everything we left out.
        rest = expected.clone()
        rest[entry.top_ids] = float("-inf")
        assert float(rest.max()) <= entry.top_logprobs[-1] + TOLERANCE, position


def greedy(num_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_logprobs_match_transformers(
    arch: str, tiny_qwen3_dir: Path, tiny_llama_dir: Path
) -> None:
    """Three requests in one batch, one longer than the 32-token budget (chunked prefill);
    two ask for different numbers of alternatives, one asks for none."""
    model_dir = tiny_qwen3_dir if arch == "qwen3" else tiny_llama_dir
    engine = make_engine(model_dir, budget=32, block_size=8)
    prompts = _prompts(2048, [7, 45, 12], seed=11)
    got = run_with_logprobs(
        engine,
        {
            "five": (prompts[0], greedy(6, 5)),
            "twenty": (prompts[1], greedy(5, 20)),
            "none": (prompts[2], greedy(4, None)),
        },
    )
    for request_id, prompt, k in (("five", prompts[0], 5), ("twenty", prompts[1], 20)):
        tokens, entries = got[request_id]
        assert all(len(e.top_ids) == k for e in entries)
        assert_matches_oracle(model_dir, prompt, tokens, entries)
    assert set(got["none"][1]) == {None}  # every output of it carried new_logprobs=None
    assert_pool_full(engine)


def test_default_model_logprobs_match_transformers(default_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir)
    prompt = tokenizer.encode("Once upon a time, there was a little girl named Lily. She")
    engine = make_engine(default_model_dir, budget=16)
    tokens, entries = run_with_logprobs(engine, {"story": (prompt, greedy(6, 3))})["story"]
    assert_matches_oracle(default_model_dir, prompt, tokens, entries)


def test_logprobs_zero_is_the_sampled_token_alone() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    [entry] = Sampler(torch.device("cpu")).logprobs(logits, [SamplingParams(logprobs=0)], [0])
    assert entry is not None and entry.top_ids == [] and entry.top_logprobs == []
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))


def test_logprobs_are_of_the_raw_distribution_not_the_tempered_one() -> None:
    """vLLM's default: temperature shapes what is drawn, not the logprobs reported."""
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    hot = SamplingParams(temperature=5.0, logprobs=1)
    [entry] = Sampler(torch.device("cpu")).logprobs(logits, [hot], [1])
    assert entry is not None
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


def test_rows_without_logprobs_compute_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("log_softmax ran for a batch that asked for no logprobs")

    monkeypatch.setattr(torch, "log_softmax", forbidden)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0)] * 3
    assert Sampler(torch.device("cpu")).logprobs(logits, params, [1, 2, 3]) == [None] * 3


def test_minus_infinity_is_clamped_to_json_safe_number() -> None:
    logits = torch.tensor([[0.0, float("-inf")]])
    [entry] = Sampler(torch.device("cpu")).logprobs(logits, [SamplingParams(logprobs=2)], [1])
    assert entry is not None and entry.logprob == -9999.0 and entry.top_logprobs[-1] == -9999.0


def test_scheduler_keeps_logprobs_only_for_requests_that_asked() -> None:
    sched = fakes.make_scheduler()
    asked = fakes.make_request(request_id="a", logprobs=2)
    plain = fakes.make_request(request_id="b")
    sched.add_request(asked)
    sched.add_request(plain)
    out = sched.schedule(0.0)
    runner = fakes.FakeRunner().execute(out)
    runner.logprobs["a"] = TokenLogprobs(-0.5, [7, 3], [-0.5, -1.0])
    outputs = {o.request_id: o for o in sched.update(out, runner, 0.0)}
    assert outputs["a"].new_logprobs == [TokenLogprobs(-0.5, [7, 3], [-0.5, -1.0])]
    assert outputs["b"].new_logprobs is None and plain.output_logprobs == []


def test_relayed_first_token_logprobs_reach_the_decode_output() -> None:
    """Pull: P's answer carries first_token_logprobs beside first_token_id; D emits the token
    with them, and the tokens it samples itself with none from the fake runner (null)."""
    connector = fakes.FakeConnector(delay=1)
    sched = fakes.make_scheduler(connector=connector)
    req = fakes.make_request(max_tokens=2, remote_prefill=True, first_token_id=5, logprobs=1)
    relayed = TokenLogprobs(-0.25, [5], [-0.25])
    assert req.kv_transfer_params is not None
    req.kv_transfer_params.first_token_logprobs = relayed.to_dict()
    sched.add_request(req)
    outputs = fakes.drain(sched, fakes.FakeRunner(), connector)
    assert outputs[0].new_token_ids == [5] and outputs[0].new_logprobs == [relayed]
    assert req.output_logprobs == [relayed, None]
    fakes.assert_no_leaks(sched)


def test_prefill_answer_carries_first_token_logprobs() -> None:
    connector = PullScheduler(4, KVIdentity("p", "127.0.0.1", 1), lease_s=5.0)
    sched = fakes.make_scheduler(connector=connector)
    req = fakes.make_request(max_tokens=1, remote_decode=True, logprobs=1)
    sched.add_request(req)
    out = sched.schedule(0.0)
    runner = fakes.FakeRunner().execute(out)
    runner.logprobs[req.request_id] = TokenLogprobs(-0.5, [7], [-0.5])
    [answer] = sched.update(out, runner, 0.0)
    assert answer.kv_transfer_params is not None
    assert (
        answer.kv_transfer_params.first_token_logprobs == runner.logprobs[req.request_id].to_dict()
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"logprob": "x", "top_ids": [], "top_logprobs": []},
        {"logprob": -1.0, "top_ids": [1], "top_logprobs": []},
        {"logprob": -1.0, "top_ids": [-1], "top_logprobs": [-1.0]},
        {"logprob": -1.0},
        [1],
    ],
)
def test_malformed_relayed_logprobs_are_refused(bad: object) -> None:
    with pytest.raises(TypeError):
        KVTransferParams.from_dict({"do_remote_prefill": True, "first_token_logprobs": bad})


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_sampling_params_refuse_bad_logprobs(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]
