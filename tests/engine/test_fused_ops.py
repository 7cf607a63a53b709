"""The fused pointwise kernels against the torch ops they replace: the residual add and the
RMSNorm after it, SiLU(gate) x up. fp32: the same numbers up to summation order; bf16: the sum
exactly as torch rounds it, the rest within one bf16 step (we round once where torch rounds
twice)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.cpu_kernels import load_library
from disagg.engine.fused_ops import FusedOps, make_fused_ops

BF16_STEP = 2**-7  # relative spacing of bf16 values


@pytest.fixture(scope="module")
def ops_for() -> object:
    if load_library() is None:
        pytest.skip("no C++ compiler here: the engine runs torch's ops (tested elsewhere)")

    def make(dtype: torch.dtype) -> FusedOps:
        ops = make_fused_ops("auto", torch.device("cpu"), dtype)
        assert ops is not None
        return ops

    return make


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm_matches_add_then_rms_norm(ops_for, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    out, summed = ops_for(dtype).add_rms_norm(x, residual, weight, 1e-5)
    expected_sum = x + residual
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)  # as torch rounds it
    expected = F.rms_norm(expected_sum, (576,), weight, 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else BF16_STEP
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_silu_times_up(ops_for, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(5, 2 * 96, generator=gen) * 4).to(dtype)
    out = ops_for(dtype).silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up  # in fp32: ours rounds once from this
    assert out.shape == (5, 96) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else BF16_STEP
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_the_torch_backend_and_other_devices_keep_torchs_ops() -> None:
    assert make_fused_ops("torch", torch.device("cpu"), torch.float32) is None
    assert make_fused_ops("auto", torch.device("meta"), torch.float32) is None
    assert make_fused_ops("auto", torch.device("cpu"), torch.float16) is None
