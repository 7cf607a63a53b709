"""The paged attention kernels against the math they replace: softmax(q k^T / sqrt(D)) v over
each sequence's keys, gathered from its blocks, in fp32 (prefill: causal, after any cached
prefix). Blocks scattered through the cache, every length class (one key, a block boundary
exactly, mid-block, past a 16-token tile), GQA group sizes our models use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.cpu_kernels import load_library
from disagg.engine.paged_attention import make_paged_attention

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE = 64, 3, 8
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: the output's own rounding


def _gathered(kv, layer, blocks, num_keys):  # one sequence's first keys -> K, V [Hkv, n, D] fp32
    hkv, d = kv.shape[3], kv.shape[5]
    k, v = (kv[blocks, layer, i].float().transpose(0, 1).reshape(hkv, -1, d) for i in (0, 1))
    return k[:, :num_keys], v[:, :num_keys]


def _reference(q, kv, layer, table, lens):  # decode: q [B, Hq, D] -> [B, Hq, D], fp32
    hkv, d = kv.shape[3], kv.shape[5]
    outs = []
    for b, n in enumerate(lens.tolist()):
        k, v = _gathered(kv, layer, table[b, : -(-n // BLOCK_SIZE)], n)
        qg = q[b].float().view(hkv, -1, d)  # the query heads of each KV head
        outs.append(F.scaled_dot_product_attention(qg, k, v).reshape(-1, d))
    return torch.stack(outs)


def _prefill_reference(q, kv, layer, blocks, start):  # q [n, Hq, D] -> [n, Hq, D], fp32
    n, num_heads, _ = q.shape
    ctx = start + n
    k, v = _gathered(kv, layer, blocks, ctx)
    groups = num_heads // kv.shape[3]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)  # [Hq, ctx, D]
    visible = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]  # [n, ctx]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=visible)
    return out.transpose(0, 1)


def _assert_matches(out: torch.Tensor, q: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == q.dtype and out.shape == q.shape
    tolerance = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    if load_library() is None:
        pytest.skip("no C++ compiler here: the engine runs the torch path (tested elsewhere)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (8, 1, 128)]
)
def test_kernel_matches_attention_over_gathered_blocks(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    kv = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, num_kv_heads, BLOCK_SIZE, head_dim, generator=gen)
    kv = kv.to(dtype)
    lens = torch.tensor([1, BLOCK_SIZE, BLOCK_SIZE + 3, 5 * BLOCK_SIZE, 37])
    width = -(-int(lens.max()) // BLOCK_SIZE)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    kernel = make_paged_attention("native", kv, num_heads, num_kv_heads)
    assert kernel is not None
    for layer in range(NUM_LAYERS):
        _assert_matches(
            kernel.decode(layer, q, table, lens), q, _reference(q, kv, layer, table, lens)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (8, 1, 128)]
)
@pytest.mark.parametrize(
    ("start", "num_tokens"), [(0, 2), (0, 16), (0, 45), (3, 1), (13, 40), (16, 16), (40, 3)]
)
def test_prefill_kernel_matches_causal_attention_over_gathered_blocks(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    start: int,
    num_tokens: int,
) -> None:
    """Chunks from the first token and after a cached prefix, shorter than a tile, exactly one,
    across tiles and blocks: each token sees its prefix and itself, nothing later."""
    gen = torch.Generator().manual_seed(num_heads * head_dim + start)
    kv = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, num_kv_heads, BLOCK_SIZE, head_dim, generator=gen)
    kv = kv.to(dtype)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: -(-(start + num_tokens) // BLOCK_SIZE)]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    kernel = make_paged_attention("native", kv, num_heads, num_kv_heads)
    assert kernel is not None
    for layer in range(NUM_LAYERS):
        expected = _prefill_reference(q, kv, layer, blocks, start)
        _assert_matches(kernel.prefill(layer, q, blocks, start), q, expected)


def test_prefill_of_a_later_token_does_not_change_an_earlier_ones_output() -> None:
    """Causality itself: the outputs of tokens 0..k-1 are the same whether the chunk stops at
    k or goes on (a later key that leaked in would change them)."""
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, 3, BLOCK_SIZE, 64, generator=gen)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:6]
    q = torch.randn(40, 9, 64, generator=gen)
    kernel = make_paged_attention("native", kv, 9, 3)
    assert kernel is not None
    torch.testing.assert_close(
        kernel.prefill(0, q, blocks, 0)[:21], kernel.prefill(0, q[:21], blocks, 0)
    )


def test_a_strided_query_is_read_as_its_values() -> None:
    """The model hands q as a slice of the fused projection (strided rows)."""
    kv = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, 3, BLOCK_SIZE, 64)
    wide = torch.randn(2, 15, 64)  # q|k|v heads side by side
    q, table, lens = wide[:, :9], torch.tensor([[3, 9], [4, 0]]), torch.tensor([11, 2])
    kernel = make_paged_attention("native", kv, 9, 3)
    assert kernel is not None
    torch.testing.assert_close(kernel.decode(1, q, table, lens), _reference(q, kv, 1, table, lens))
    prefix = torch.tensor([5, 2])
    torch.testing.assert_close(
        kernel.prefill(1, wide[:, :9], prefix, 9), _prefill_reference(wide[:, :9], kv, 1, prefix, 9)
    )


def test_backends_where_the_kernel_cannot_run() -> None:
    """fp16 (no kernel): auto falls back to torch, native refuses; torch never builds one."""
    kv = torch.zeros(4, 1, 2, 1, BLOCK_SIZE, 64, dtype=torch.float16)
    assert make_paged_attention("auto", kv, 2, 1) is None
    with pytest.raises(ValueError, match="native"):
        make_paged_attention("native", kv, 2, 1)
    assert make_paged_attention("torch", kv.float(), 2, 1) is None
    assert make_paged_attention("auto", torch.zeros(4, 1, 2, 1, BLOCK_SIZE, 96), 2, 1) is None


@pytest.mark.parametrize("compiler", ["no-such-compiler-here", "false"])
def test_without_a_working_compiler_auto_runs_torch_and_native_refuses(
    compiler: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """No compiler on PATH, or one that fails: logged, never raised from auto."""
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    load_library.cache_clear()
    try:
        kv = torch.zeros(4, 1, 2, 1, BLOCK_SIZE, 64)
        assert make_paged_attention("auto", kv, 2, 1) is None
        with pytest.raises(ValueError, match="did not build"):
            make_paged_attention("native", kv, 2, 1)
    finally:
        load_library.cache_clear()  # the next caller builds (or finds) the real one
