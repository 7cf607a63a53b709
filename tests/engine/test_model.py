"""CausalLM pieces that the equivalence tests do not isolate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from disagg.engine.linear import packable, to_packed
from disagg.engine.model import CausalLM
from disagg.engine.model_spec import ModelSpec


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_sliced_vocabulary_projection_equals_one_matmul(tiny_qwen3_dir: Path, rows: int) -> None:
    model = CausalLM(ModelSpec.from_dir(tiny_qwen3_dir))
    # A vocabulary that is not a multiple of the slice, so the last slice is short.
    model.lm_head = nn.Linear(model.spec.hidden_size, 5000, bias=False)
    hidden = torch.randn(rows, model.spec.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.shape == (rows, 5000) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ model.lm_head.weight.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(bias: bool, dtype: torch.dtype) -> None:
    if not packable(torch.device("cpu"), dtype):
        pytest.skip("this torch has no oneDNN packed linear")
    linear = nn.Linear(48, 80, bias=bias, dtype=dtype)
    x = torch.randn(5, 48, dtype=dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(to_packed(linear)(x), linear(x), **tol)


def test_fused_projections_compute_what_the_separate_ones_did(tiny_qwen3_dir: Path) -> None:
    """q|k|v and gate|up fused (and packed on CPU): the same outputs as the loaded layers."""
    spec = ModelSpec.from_dir(tiny_qwen3_dir)
    model = CausalLM(spec)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(7, spec.hidden_size)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    mlp_out = mlp(x)
    model.prepare_for_inference(pack=packable(torch.device("cpu"), torch.float32))
    fused_q, fused_k, fused_v = attn._qkv(x)
    for got, want in ((fused_q, q), (fused_k, k), (fused_v, v), (mlp(x), mlp_out)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
