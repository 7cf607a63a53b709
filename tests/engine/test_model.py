"""CausalLM pieces that the equivalence tests do not isolate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from disagg.engine.checkpoint import ModelSpec
from disagg.engine.model import CausalLM, InputMajorLinear


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_sliced_vocabulary_projection_equals_one_matmul(tiny_qwen3_dir: Path, rows: int) -> None:
    model = CausalLM(ModelSpec.from_dir(tiny_qwen3_dir))
    # A vocabulary that is not a multiple of the slice, so the last slice is short.
    model.lm_head = nn.Linear(model.spec.hidden_size, 5000, bias=False)
    hidden = torch.randn(rows, model.spec.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.shape == (rows, 5000) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ model.lm_head.weight.T)


@pytest.mark.parametrize("bias", [False, True])
def test_input_major_linear_equals_linear(bias: bool) -> None:
    linear = nn.Linear(48, 80, bias=bias)
    swapped = InputMajorLinear(linear)
    assert swapped.weight_t.shape == (48, 80) and swapped.weight_t.is_contiguous()
    x = torch.randn(5, 48)
    torch.testing.assert_close(swapped(x), linear(x))


def test_input_major_weights_replace_every_decoder_projection(tiny_qwen3_dir: Path) -> None:
    model = CausalLM(ModelSpec.from_dir(tiny_qwen3_dir))
    model.use_input_major_weights()
    kinds = {type(m) for layer in model.model.layers for m in layer.modules()}
    assert InputMajorLinear in kinds and nn.Linear not in kinds
    assert isinstance(model.lm_head, nn.Linear)  # tied to the embedding: left as it is
