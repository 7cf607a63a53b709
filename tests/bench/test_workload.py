"""Workloads are seeded, exact in length, and respect the range ratio."""

from __future__ import annotations

import pytest

from disagg.bench.workload import (
    WorkloadConfig,
    length_bounds,
    make_workload,
    to_text_prompts,
)


class WordTokenizer:
    """One token per character code: enough to check exact lengths and decoding."""

    class _Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

    def encode(self, text: str) -> _Encoding:
        return self._Encoding([ord(c) for c in text])

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_random_same_seed_same_prompts_other_seed_differs() -> None:
    cfg = WorkloadConfig(num_prompts=8, input_len=40, output_len=8, range_ratio=0.5, seed=7)
    a, b = make_workload(cfg), make_workload(cfg)
    assert a == b
    c = make_workload(WorkloadConfig(**{**_kwargs(cfg), "seed": 8}))
    assert [p.prompt for p in a] != [p.prompt for p in c]


def _kwargs(cfg: WorkloadConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__slots__}


def test_random_lengths_exact_and_ids_in_range() -> None:
    cfg = WorkloadConfig(num_prompts=20, input_len=33, output_len=5, token_range=(100, 110))
    prompts = make_workload(cfg)
    assert len(prompts) == 20
    for p in prompts:
        assert isinstance(p.prompt, list) and len(p.prompt) == p.input_len == 33
        assert p.output_len == 5 and p.is_exact_len
        assert all(100 <= t < 110 for t in p.prompt)
    assert len({t for p in prompts for t in p.prompt}) == 10  # the whole range is used


def test_range_ratio_bounds_respected_and_spread() -> None:
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(10, 0.0) == (10, 10)
    assert length_bounds(1, 0.9) == (1, 2)  # never below one token
    cfg = WorkloadConfig(num_prompts=400, input_len=100, output_len=20, range_ratio=0.25)
    prompts = make_workload(cfg)
    in_lens = [p.input_len for p in prompts]
    out_lens = [p.output_len for p in prompts]
    assert min(in_lens) >= 75 and max(in_lens) <= 125
    assert min(out_lens) >= 15 and max(out_lens) <= 25
    assert max(in_lens) - min(in_lens) > 40  # actually spread, not constant
    assert abs(sum(in_lens) / len(in_lens) - 100) < 3
    assert all(len(p.prompt) == p.input_len for p in prompts)


def test_prefix_prompts_share_prefix() -> None:
    cfg = WorkloadConfig(dataset="prefix", num_prompts=6, input_len=10, prefix_len=16, seed=3)
    prompts = make_workload(cfg)
    prefix = prompts[0].prompt[:16]
    for p in prompts:
        assert p.input_len == len(p.prompt) == 26
        assert p.prompt[:16] == prefix
    assert len({tuple(p.prompt[16:]) for p in prompts}) == 6  # suffixes differ
    two = make_workload(WorkloadConfig(**{**_kwargs(cfg), "num_prefixes": 2}))
    assert two[0].prompt[:16] == two[2].prompt[:16] != two[1].prompt[:16]


def test_text_prompts_from_bundled_corpus() -> None:
    cfg = WorkloadConfig(dataset="text", num_prompts=5, input_len=65, output_len=4, seed=1)
    prompts = make_workload(cfg)
    assert prompts == make_workload(cfg)
    for p in prompts:
        assert isinstance(p.prompt, str) and not p.is_exact_len
        assert len(p.prompt.split()) == 50  # 65 tokens / 1.3 tokens per word
    assert len({p.prompt for p in prompts}) == 5


def test_text_prompts_exact_with_tokenizer_and_chat_decoding() -> None:
    tok = WordTokenizer()
    cfg = WorkloadConfig(dataset="text", num_prompts=3, input_len=40, seed=2)
    for p in make_workload(cfg, tok):
        assert len(tok.encode(p.prompt).ids) == 40
    ids = make_workload(WorkloadConfig(num_prompts=2, input_len=5, token_range=(65, 70)))
    texts = to_text_prompts(ids, tok)
    assert [t.prompt for t in texts] == [tok.decode(p.prompt) for p in ids]
    assert all(len(t.prompt) == 5 for t in texts)


@pytest.mark.parametrize(
    "bad",
    [
        {"range_ratio": 1.0},
        {"input_len": 0},
        {"token_range": (5, 5)},
        {"dataset": "sharegpt"},
    ],
)
def test_invalid_config_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**bad)
