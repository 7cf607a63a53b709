"""The default model in bf16, held to fp32 by measures that survive a change of GEMM kernel.

Where fp32's best two tokens lie within bf16's rounding (~0.2 nats on this model), either pick
is right, and which one a CPU makes depends on its kernel: AMX, AVX512-BF16 and emulated bf16
each round differently. So no test here asserts a bf16 answer that sits on such a tie:
- on a fixed text (teacher-forced: the engine is fed the text whatever it would pick), our
  bf16 argmax agrees with transformers-fp32's as often as transformers-bf16's does, less a
  stated slack, every one of our picks is near fp32's best, and the mean KL is as small;
- answers are asserted only for `CLEAR_ANSWERS`, whose fp32 margins the test measures first.
The agreement test runs again with oneDNN capped below this CPU's ISA (another kernel family,
in a process of its own: oneDNN reads ONEDNN_MAX_CPU_ISA once, when it starts).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from disagg.protocol import SamplingParams
from disagg.server.tokenizer import Tokenizer
from tests.engine.clear_answers import CLEAR_ANSWERS, MIN_MARGIN_NATS, chat_prompt
from tests.engine.test_equivalence import (
    _hf_model,
    assert_pool_full,
    hf_greedy,
    make_engine,
    run_to_end,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Short and varied: chat questions (factual, open, instructions) and plain-text continuations.
AGREEMENT_CHATS = (
    "What is the capital of France?", "What color is the sky?", "Say hello.",
    "How many legs does a spider have?", "Who wrote Romeo and Juliet?", "What is 2 + 2?",
    "Name a fruit that is yellow.", "Why do birds migrate?", "Tell me a joke.",
    "Give me a word that rhymes with cat.", "What is the opposite of hot?", "What does a bee make?",
)  # fmt: skip
AGREEMENT_TEXTS = (
    "Once upon a time, there was a little girl named Lily. She", "The three primary colors are",
    "def fibonacci(n):", "The quick brown fox", "In 1492, Columbus", "Water boils at",
    "My favorite food is", "The best way to learn a language is", "import numpy as np\n",
    "Dear Sir or Madam,", "1, 2, 3, 4,", "The cat sat on the",
)  # fmt: skip
NUM_SCORED_TOKENS = 6  # per prompt: 24 x 6 = 144 positions, 26 within 0.3 nats of an fp32 tie

# The stated tolerances. Measured on the development CPU (AVX512-BF16; also capped to
# AVX512_CORE and to AVX2, where the engine falls back to unpacked weights):
# transformers-bf16 agrees with fp32 at 140-141 of 144 positions and ours at 140-142; our
# worst pick is 0.2 nats below fp32's best; mean KL 0.0013-0.0016 nats for both. Broken on
# purpose: a decode that misses its newest key agrees at 123 (worst pick 5 nats off, KL x80);
# attention scores 10% too hot still agree, but their KL is 5.5x transformers-bf16's.
AGREEMENT_SLACK = 3  # positions ours may agree less often than transformers-bf16
MAX_GAP_NATS = 0.5  # each of our picks: fp32 log-prob within this of fp32's best ...
TOP_K = 3  # ... and among fp32's top 3
KL_FACTOR = 2.0  # our mean KL(fp32 || bf16) at most this times transformers-bf16's

CAPPED_ISA = "AVX512_CORE"  # AVX-512 without bf16 instructions: oneDNN emulates bf16


def _agreement_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [chat_prompt(tokenizer, q) for q in AGREEMENT_CHATS] + [
        tokenizer.encode(t) for t in AGREEMENT_TEXTS
    ]


class ForcingSampler:
    """Stands in for the engine's sampler: records the logits of each sampled row and returns
    the fixed text's next token instead of its own pick, so prefill and decode run on exactly
    the text the reference scored. A request is named by its seed, which greedy ignores."""

    def __init__(self, texts: list[list[int]]) -> None:
        self.texts = texts
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # (prompt, position) -> [vocab]

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> list[int | None]:
        picks: list[int | None] = []
        for row, sampling, index in zip(logits, params, output_indices, strict=True):
            assert sampling.seed is not None, "every forced request carries its prompt index"
            self.logits[(sampling.seed, index)] = row.float().clone()
            picks.append(self.texts[sampling.seed][index])
        return picks

    def logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], tokens: list[int | None]
    ) -> list[None]:
        """No request here asks for logprobs: the logits recorded above are what is compared."""
        return [None] * len(params)


def engine_forced_logits(
    model_dir: Path, prompts: list[list[int]], texts: list[list[int]], dtype: str
) -> list[torch.Tensor]:
    """Our logits at each position of each text, all requests batched (budget 64: the longer
    prompts prefill in chunks beside the others' decodes). One [len(text), vocab] per prompt."""
    engine = make_engine(model_dir, budget=64, dtype=dtype)
    sampler = ForcingSampler(texts)
    engine.runner.sampler = sampler
    for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        forced = SamplingParams(max_tokens=len(text), temperature=0.0, ignore_eos=True, seed=i)
        engine.add_request(f"r{i}", prompt, forced)
    while engine.has_work:
        engine.step()
    assert_pool_full(engine)
    return [
        torch.stack([sampler.logits[(i, j)] for j in range(len(t))]) for i, t in enumerate(texts)
    ]


def hf_forced_logits(
    model_dir: Path, prompts: list[list[int]], texts: list[list[int]], dtype: torch.dtype
) -> list[torch.Tensor]:
    model = _hf_model(str(model_dir), dtype)
    with torch.inference_mode():
        return [
            model(torch.tensor([p + t])).logits[0, len(p) - 1 : -1].float()
            for p, t in zip(prompts, texts, strict=True)
        ]


def _kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per row, in nats."""
    ref, oth = reference.log_softmax(-1), other.log_softmax(-1)
    return (ref.exp() * (ref - oth)).sum(-1)


@dataclass(frozen=True, slots=True)
class Fp32Reference:
    """The fixed texts and transformers-fp32's logits on them (teacher-forced)."""

    prompts: list[list[int]]
    texts: list[list[int]]  # per prompt: our fp32 greedy continuation, NUM_SCORED_TOKENS long
    logits: torch.Tensor  # [num_positions, vocab] fp32, the prompts' rows end to end


@functools.lru_cache(maxsize=1)
def fp32_reference(model_dir: Path) -> Fp32Reference:
    """Texts from our fp32 engine (test_equivalence pins its greedy tokens to transformers'),
    scored by transformers-fp32."""
    prompts = _agreement_prompts(Tokenizer.from_dir(model_dir))
    arrivals = {0: [(f"r{i}", p, NUM_SCORED_TOKENS) for i, p in enumerate(prompts)]}
    continued = run_to_end(make_engine(model_dir, budget=512), arrivals)
    texts = [continued[f"r{i}"] for i in range(len(prompts))]
    logits = torch.cat(hf_forced_logits(model_dir, prompts, texts, torch.float32))
    return Fp32Reference(prompts, texts, logits)


def bf16_agreement(model_dir: Path, ref: Fp32Reference) -> dict[str, float]:
    """Our bf16 engine and transformers-bf16, each against the fp32 reference."""
    hf_bf16 = torch.cat(hf_forced_logits(model_dir, ref.prompts, ref.texts, torch.bfloat16))
    ours = torch.cat(engine_forced_logits(model_dir, ref.prompts, ref.texts, "bfloat16"))
    best = ref.logits.argmax(-1)  # [num_positions]
    fp32_logprobs = ref.logits.log_softmax(-1)
    ours_pick = ours.argmax(-1, keepdim=True)
    gaps = fp32_logprobs.max(-1).values - fp32_logprobs.gather(-1, ours_pick)[:, 0]
    ranks = (ref.logits > ref.logits.gather(-1, ours_pick)).sum(-1)  # 0 = fp32's own best
    return {
        "num_positions": len(best),
        "ours_agree": int((ours.argmax(-1) == best).sum()),
        "hf_bf16_agree": int((hf_bf16.argmax(-1) == best).sum()),
        "ours_worst_gap_nats": float(gaps.max()),
        "ours_worst_rank": int(ranks.max()),
        "ours_mean_kl": float(_kl(ref.logits, ours).mean()),
        "hf_bf16_mean_kl": float(_kl(ref.logits, hf_bf16).mean()),
    }


def print_onednn_isa() -> None:
    """oneDNN prints an info line with its ISA on its first verbose use in a process."""
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8), 1)


def _env_with_max_isa(max_isa: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    return env if max_isa is None else {**env, "ONEDNN_MAX_CPU_ISA": max_isa}


def _onednn_isa(max_isa: str | None) -> str:
    """The ISA oneDNN dispatches to in a fresh process under that cap (None: uncapped)."""
    probe = "from tests.engine.test_bf16_accuracy import print_onednn_isa as p; p()"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=_env_with_max_isa(max_isa), cwd=REPO_ROOT,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return next(line.split("isa:", 1)[1] for line in done.stdout.splitlines() if "isa:" in line)


def _agreement_in_process_of_its_own(
    model_dir: Path, ref: Fp32Reference, max_isa: str, scratch: Path
) -> dict[str, float]:
    """bf16_agreement under that oneDNN cap; the fp32 reference travels as a file."""
    torch.save({"prompts": ref.prompts, "texts": ref.texts, "logits": ref.logits}, scratch)
    argv = [sys.executable, "-m", "tests.engine.test_bf16_accuracy", str(model_dir), str(scratch)]
    done = subprocess.run(
        argv, env=_env_with_max_isa(max_isa), cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("max_isa", [None, CAPPED_ISA], ids=["native-isa", CAPPED_ISA])
def test_bf16_default_model_agrees_with_fp32_as_often_as_transformers_bf16(
    default_model_dir: Path, max_isa: str | None, tmp_path: Path
) -> None:
    if max_isa is None:
        isa = "native"
        stats = bf16_agreement(default_model_dir, fp32_reference(default_model_dir))
    else:
        isa = _onednn_isa(max_isa)
        if isa == _onednn_isa(None):
            pytest.skip(f"this CPU runs oneDNN at {isa} already: the cap changes nothing")
        ref, path = fp32_reference(default_model_dir), tmp_path / "fp32.pt"
        stats = _agreement_in_process_of_its_own(default_model_dir, ref, max_isa, path)
    why = f"oneDNN ISA {isa}: {stats}"
    assert stats["num_positions"] == len(AGREEMENT_CHATS + AGREEMENT_TEXTS) * NUM_SCORED_TOKENS
    assert stats["ours_agree"] >= stats["hf_bf16_agree"] - AGREEMENT_SLACK, why
    assert stats["ours_worst_rank"] < TOP_K and stats["ours_worst_gap_nats"] <= MAX_GAP_NATS, why
    assert stats["ours_mean_kl"] <= KL_FACTOR * stats["hf_bf16_mean_kl"], why


def _clear_prefix(tokenizer: Tokenizer, tokens: list[int], answer: str) -> list[int]:
    """The shortest prefix of `tokens` whose text holds `answer`."""
    for n in range(1, len(tokens) + 1):
        if answer in tokenizer.decode(tokens[:n]):
            return tokens[:n]
    raise AssertionError(f"fp32 reply {tokenizer.decode(tokens)!r} does not say {answer!r}")


def test_bf16_default_model_answers_where_fp32_is_clear(default_model_dir: Path) -> None:
    """(1) transformers-fp32 answers each clear question with a wide margin at every token up to
    the answer (measured, not assumed); (2) our bf16 engine, batched and chunked, says the same
    tokens."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    prompts = [chat_prompt(tokenizer, question) for question, _ in CLEAR_ANSWERS]
    answers = [  # (1)
        _clear_prefix(tokenizer, hf_greedy(default_model_dir, prompt, 10), answer)
        for prompt, (_, answer) in zip(prompts, CLEAR_ANSWERS, strict=True)
    ]
    fp32 = hf_forced_logits(default_model_dir, prompts, answers, torch.float32)
    for (question, _), logits in zip(CLEAR_ANSWERS, fp32, strict=True):
        top2 = logits.log_softmax(-1).topk(2).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        assert min(margins) >= MIN_MARGIN_NATS, (question, margins)
    engine = make_engine(default_model_dir, budget=16, dtype="bfloat16")  # (2)
    arrivals = {
        0: [(f"q{i}", p, len(a)) for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    }
    tokens = run_to_end(engine, arrivals)
    for i, (question, _) in enumerate(CLEAR_ANSWERS):
        assert tokens[f"q{i}"] == answers[i], (question, tokenizer.decode(tokens[f"q{i}"]))
    assert_pool_full(engine)


if __name__ == "__main__":  # the figures under the caller's ONEDNN_MAX_CPU_ISA; JSON last
    torch.set_num_threads(1)
    saved = torch.load(sys.argv[2])
    reference = Fp32Reference(saved["prompts"], saved["texts"], saved["logits"])
    print(json.dumps(bf16_agreement(Path(sys.argv[1]), reference)))
