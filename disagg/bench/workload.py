"""Seeded benchmark workloads: random token ids, English text, shared-prefix prompts, and the
text pieces of multi-turn conversations (bench/multiturn.py plays them).

Owns turning (dataset, lengths, seed) into a reproducible list of `BenchPrompt`s. The same
config and seed always give the same prompts. Does no I/O beyond reading an optional tokenizer
file, and never imports torch.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

__all__ = [
    "BenchPrompt",
    "DatasetName",
    "TextTokenizer",
    "WorkloadConfig",
    "length_bounds",
    "load_tokenizer",
    "make_workload",
    "make_texts",
    "to_text_prompts",
]

DatasetName = Literal["random", "text", "prefix", "multiturn"]
DATASETS: tuple[str, ...] = ("random", "text", "prefix", "multiturn")

# Rough English ratio, used only when no tokenizer is given for the text workload: the true
# prompt length is then read back from the server's `usage.prompt_tokens`.
_TOKENS_PER_WORD = 1.3


class TextTokenizer(Protocol):
    """The two calls the workload needs from a tokenizer (a `tokenizers.Tokenizer` fits)."""

    def encode(self, text: str) -> object: ...  # returns an object with `.ids`

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One request of a workload."""

    prompt: str | list[int]  # token ids (exact length) or text
    input_len: int  # tokens; exact for ids, an estimate for text without a tokenizer
    output_len: int  # tokens requested via max_tokens (+ ignore_eos)
    is_exact_len: bool  # True when input_len is known exactly (token ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadConfig:
    dataset: DatasetName = "random"
    num_prompts: int = 100  # multiturn: conversations
    input_len: int = (
        128  # tokens; prefix: the suffix after the shared prefix; multiturn: a user turn
    )
    output_len: int = 32  # tokens
    range_ratio: float = 0.0  # lengths uniform in [len*(1-r), len*(1+r)]
    prefix_len: int = 64  # tokens shared by prompts of one group (prefix); multiturn: system prompt
    num_prefixes: int = 1  # distinct shared prefixes, assigned round-robin
    token_range: tuple[int, int] = (100, 1900)  # ids drawn from [lo, hi): avoids special tokens
    num_turns: int = 1  # multiturn: turns per conversation, played in order
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        for name in ("num_prompts", "input_len", "output_len", "num_prefixes", "num_turns"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_range must satisfy 0 <= lo < hi, got {self.token_range}")


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths drawn around `length` (never below 1)."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def _draw_lengths(rng: np.random.Generator, length: int, ratio: float, n: int) -> list[int]:
    low, high = length_bounds(length, ratio)
    return rng.integers(low, high + 1, size=n).tolist()  # Python ints, one C call


def _random_ids(rng: np.random.Generator, token_range: tuple[int, int], n: int) -> list[int]:
    # Looked up in a table of int objects rather than `.tolist()` of the draw: the same ids,
    # but every prompt shares one object per id (8 bytes a token instead of ~36). A simulated
    # run of 10k 16k-token prompts holds thousands of them at once.
    return _id_table(token_range[1])[rng.integers(token_range[0], token_range[1], size=n)].tolist()


@functools.lru_cache(maxsize=4)
def _id_table(size: int) -> np.ndarray:
    """The Python ints 0..size-1 as an object array (indexing it copies references)."""
    return np.array(range(size), dtype=object)


def _random_prompts(cfg: WorkloadConfig, rng: np.random.Generator) -> list[BenchPrompt]:
    in_lens = _draw_lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    out_lens = _draw_lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    prompts = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        ids = _random_ids(rng, cfg.token_range, in_len)
        prompts.append(BenchPrompt(ids, in_len, out_len, is_exact_len=True))
    return prompts


def _prefix_prompts(cfg: WorkloadConfig, rng: np.random.Generator) -> list[BenchPrompt]:
    prefixes = [_random_ids(rng, cfg.token_range, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    suffixes = _random_prompts(cfg, rng)
    prompts = []
    for i, suffix in enumerate(suffixes):
        ids = prefixes[i % cfg.num_prefixes] + list(suffix.prompt)
        prompts.append(BenchPrompt(ids, len(ids), suffix.output_len, is_exact_len=True))
    return prompts


def _corpus_words() -> list[str]:
    """English prose shipped with CPython (the help topics of `pydoc`), as whitespace words."""
    from pydoc_data.topics import topics  # lazy: ~0.5 MB of text

    text = " ".join(topics[key] for key in sorted(topics))
    return re.sub(r"\s+", " ", text).strip().split(" ")


def _text_prompts(
    cfg: WorkloadConfig, rng: np.random.Generator, tokenizer: TextTokenizer | None
) -> list[BenchPrompt]:
    in_lens = _draw_lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    out_lens = _draw_lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    texts = make_texts(rng, in_lens, tokenizer)
    return [
        BenchPrompt(text, in_len, out_len, is_exact_len=False)
        for text, in_len, out_len in zip(texts, in_lens, out_lens, strict=True)
    ]


def make_texts(
    rng: np.random.Generator, lengths: list[int], tokenizer: TextTokenizer | None
) -> list[str]:
    """English passages of about `lengths` tokens each (exactly, when a tokenizer is given:
    a window of the tokenized corpus, decoded), each from a random place in the corpus."""
    words = _corpus_words()
    corpus_ids = tokenizer.encode(" ".join(words)).ids if tokenizer is not None else None
    texts = []
    for n in lengths:
        if corpus_ids is not None:
            start = int(rng.integers(0, max(1, len(corpus_ids) - n)))
            texts.append(tokenizer.decode(list(corpus_ids[start : start + n])))
        else:
            num_words = max(1, round(n / _TOKENS_PER_WORD))
            start = int(rng.integers(0, max(1, len(words) - num_words)))
            texts.append(" ".join(words[start : start + num_words]))
    return texts


def make_workload(cfg: WorkloadConfig, tokenizer: TextTokenizer | None = None) -> list[BenchPrompt]:
    """The prompts of `cfg`, deterministic in `cfg.seed` (and the tokenizer, for text)."""
    rng = np.random.default_rng(cfg.seed)
    if cfg.dataset == "random":
        return _random_prompts(cfg, rng)
    if cfg.dataset == "prefix":
        return _prefix_prompts(cfg, rng)
    if cfg.dataset == "multiturn":  # each turn's prompt holds the answers before it
        raise ValueError(
            "multiturn conversations are played turn by turn, each turn after the answer "
            "before it (bench/multiturn.py, sim/conversations.py); they are not a list of prompts"
        )
    return _text_prompts(cfg, rng, tokenizer)


def to_text_prompts(prompts: list[BenchPrompt], tokenizer: TextTokenizer) -> list[BenchPrompt]:
    """Token-id prompts decoded to text, for endpoints that only take text (chat)."""
    out = []
    for p in prompts:
        text = p.prompt if isinstance(p.prompt, str) else tokenizer.decode(list(p.prompt))
        out.append(BenchPrompt(text, p.input_len, p.output_len, is_exact_len=False))
    return out


def load_tokenizer(path: str) -> TextTokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a model directory holding one."""
    from tokenizers import Tokenizer  # lazy: only the text/chat paths need it

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"tokenizer: no tokenizer.json at {path!r}")
    return Tokenizer.from_file(str(file))
