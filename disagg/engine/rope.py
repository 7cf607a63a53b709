"""Rotary position embeddings: inverse frequencies per RoPE type, cos/sin tables, and rotation.

Numbers match transformers' rope init functions bit for bit (same fp32 operations in the same
order), because greedy tokens are compared with transformers token for token. It holds no state
and no cache; the model runner decides what to precompute.
"""

from __future__ import annotations

import math

import torch

from disagg.engine.model_spec import ModelSpec

__all__ = ["cos_sin", "inv_freq_and_scale", "rope_tables", "rotate"]


def inv_freq_and_scale(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (fp32, CPU) and the factor cos and sin are scaled by."""
    base, dim = spec.rope_theta, spec.head_dim
    params = spec.rope_scaling or {"rope_type": "default"}
    rope_type = params["rope_type"]
    if rope_type == "default":
        return _default_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        # Dividing the frequencies by factor equals dividing the positions by it.
        return _default_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        return _dynamic_inv_freq(base, dim, params["factor"], spec.max_position_embeddings), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, dim, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq_and_scale(base, dim, params, spec.max_position_embeddings)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [num_tokens, head_dim] fp32, in the rotate-half layout (halves equal)."""
    inv_freq = inv_freq.to(positions.device)
    freqs = positions[:, None].float() * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
    return emb.cos() * scale, emb.sin() * scale


def rope_tables(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin from `cos_sin` prepared once per step for `rotate`: cast to the activation
    dtype (as transformers casts them), [num_tokens, 1, head_dim] to broadcast over heads, and
    the rotate-half sign folded into sin's first half (negation is exact, so the result is
    bit-identical to rotating with a negated half of x)."""
    half = cos.shape[-1] // 2
    cos, sin = cos.to(dtype), sin.to(dtype)
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None, :], signed_sin[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] with tables from `rope_tables`."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _dynamic_inv_freq(base: float, dim: int, factor: float, max_pos: int) -> torch.Tensor:
    # Static: the base as transformers computes it at init (sequence length = max positions),
    # which is the plain base. Transformers grows it once a sequence exceeds max positions; we
    # do not, so positions beyond max_position_embeddings differ (the runner caps lengths there).
    seq_len = max_pos
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim)


def _llama3_inv_freq(base: float, dim: int, params: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor, old_context_len = params["factor"], params["original_max_position_embeddings"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq_and_scale(
    base: float, dim: int, params: dict, max_pos: int
) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original
    scale = params.get("attention_factor")
    if scale is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scale = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            scale = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(
        beta_fast, beta_slow, dim, base, original, params.get("truncate", True)
    )
    # 1 where a dimension keeps its original frequency, 0 where it is fully interpolated.
    keep = 1 - _linear_ramp(low, high, dim // 2)
    return interpolation * (1 - keep) + extrapolation * keep, scale


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(
    low_rot: float, high_rot: float, dim: int, base: float, max_pos: int, truncate: bool
) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into max_pos.
        return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(low_rot), correction_dim(high_rot)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, num: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # avoid dividing by zero
    return torch.clamp((torch.arange(num, dtype=torch.float32) - low) / (high - low), 0, 1)
