"""Questions whose greedy answer the default model gives by a wide margin in fp32 and bf16
alike, for the tests that check an answer rather than a distribution.

Why a list at all: "What is the capital of France?" opens on a near tie (the first token leads
the runner-up by 0.08 nats in fp32, 0.25 in bf16), so its bf16 answer flips with the GEMM kernel
(it does on AMX). Each question here was picked by measuring the default model in fp32
and bf16 with this engine: at every greedy token up to and including the answer, the best token
leads the runner-up by at least 1.6 nats (Tokyo 2.5, Moscow 2.2, Cairo 2.1, H2O 2.5, London 1.6),
while bf16 moves a log-probability by at most ~0.2 nats here. `test_bf16_accuracy` re-measures
that premise (MIN_MARGIN_NATS) on every run, so a new checkpoint or tokenizer cannot quietly
turn one of these into a tie.
"""

from __future__ import annotations

from disagg.server.tokenizer import Tokenizer

__all__ = ["CLEAR_ANSWERS", "MIN_MARGIN_NATS", "chat_prompt"]

# (question, a word the greedy reply contains), the quickstart's question first
CLEAR_ANSWERS: tuple[tuple[str, str], ...] = (
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the chemical symbol for water?", "H2O"),
    ("What is the capital of the United Kingdom?", "London"),
)

# fp32's top-1 minus top-2 log-probability, at each token up to the answer: 5x bf16's noise
MIN_MARGIN_NATS = 1.0


def chat_prompt(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
