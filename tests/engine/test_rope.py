"""RoPE against transformers' own rotary embedding modules, for every rope type we support."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from disagg.engine.model_spec import ModelSpec
from disagg.engine.rope import cos_sin, inv_freq_and_scale, rope_tables, rotate

torch.set_num_threads(1)

_HF = {
    "llama": (LlamaConfig, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2RotaryEmbedding),
    "qwen3": (Qwen3Config, Qwen3RotaryEmbedding),
}
_SMALL = {"vocab_size": 128, "num_hidden_layers": 1, "intermediate_size": 64}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "default-smollm2": (
        "llama",
        {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
         "rope_theta": 1e5, "max_position_embeddings": 8192},
    ),
    "linear": (
        "llama",
        {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 1e4,
         "rope_scaling": {"type": "linear", "factor": 4.0}},
    ),
    "dynamic": (
        "qwen2",
        {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 4096,
         "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
    ),
    "llama3": (
        "llama",
        {"hidden_size": 512, "num_attention_heads": 4, "max_position_embeddings": 131072,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}},
    ),
    "yarn-qwen3": (
        "qwen3",
        {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 1e6,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 32768}},
    ),
    "yarn-mscale": (
        "llama",
        {"hidden_size": 256, "num_attention_heads": 2, "max_position_embeddings": 16384,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 4096, "mscale": 0.707,
                             "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                             "truncate": False}},
    ),
}  # fmt: skip


def _hf_and_spec(name: str) -> tuple[Any, Any, ModelSpec]:
    arch, values = CASES[name]
    config_cls, rotary_cls = _HF[arch]
    config = config_cls(**_SMALL, **values)
    # Parse what transformers itself would write (rope_parameters form) ...
    spec = ModelSpec.from_config(config.to_dict())
    # ... and the raw legacy-or-new dict as a user's config.json has it: same result.
    raw = ModelSpec.from_config({**_SMALL, **values, "model_type": arch})
    assert (raw.rope_theta, raw.rope_scaling, raw.head_dim) == (
        spec.rope_theta,
        spec.rope_scaling,
        spec.head_dim,
    )
    return config, rotary_cls(config), spec


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_and_scale_match_transformers(name: str) -> None:
    _, rotary, spec = _hf_and_spec(name)
    inv_freq, scale = inv_freq_and_scale(spec)
    assert inv_freq.shape == (spec.head_dim // 2,)
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, rotary.inv_freq), (inv_freq - rotary.inv_freq).abs().max()
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_and_apply_match_transformers(name: str) -> None:
    _, rotary, spec = _hf_and_spec(name)
    positions = torch.tensor([0, 1, 2, 7, 100, 3001, 4095])
    x = torch.randn(len(positions), 3, spec.head_dim, generator=torch.Generator().manual_seed(0))
    hf_cos, hf_sin = rotary(x, positions[None, :])  # [1, num_tokens, head_dim]
    cos, sin = cos_sin(*inv_freq_and_scale(spec), positions)
    assert cos.shape == sin.shape == (len(positions), spec.head_dim)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)
    hf_x, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin)
    ours = rotate(x, *rope_tables(cos, sin, x.dtype))
    torch.testing.assert_close(ours, hf_x[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_rope_scaling_changes_frequencies() -> None:
    """Guards the test above against comparing two unscaled tables."""
    specs = {name: _hf_and_spec(name)[2] for name in ("linear", "llama3", "yarn-qwen3")}
    for spec in specs.values():
        inv_freq, _ = inv_freq_and_scale(spec)
        plain = 1.0 / (
            spec.rope_theta ** (torch.arange(0, spec.head_dim, 2).float() / spec.head_dim)
        )
        assert not torch.allclose(inv_freq, plain)
    assert inv_freq_and_scale(specs["yarn-qwen3"])[1] > 1.0


def test_rotation_preserves_norm_and_position_zero() -> None:
    spec = _hf_and_spec("default-smollm2")[2]
    x = torch.randn(3, 2, spec.head_dim, generator=torch.Generator().manual_seed(1))
    cos, sin = cos_sin(*inv_freq_and_scale(spec), torch.tensor([0, 5, 900]))
    out = rotate(x, *rope_tables(cos, sin, x.dtype))
    torch.testing.assert_close(out[0], x[0])  # position 0 is the identity
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation
    assert not torch.allclose(out[1], x[1])
