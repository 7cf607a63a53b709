"""CausalLM pieces that the equivalence tests do not isolate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from disagg.engine.checkpoint import ModelSpec
from disagg.engine.model import CausalLM


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_sliced_vocabulary_projection_equals_one_matmul(tiny_qwen3_dir: Path, rows: int) -> None:
    model = CausalLM(ModelSpec.from_dir(tiny_qwen3_dir))
    # A vocabulary that is not a multiple of the slice, so the last slice is short.
    model.lm_head = nn.Linear(model.spec.hidden_size, 5000, bias=False)
    hidden = torch.randn(rows, model.spec.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.shape == (rows, 5000) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ model.lm_head.weight.T)
