"""Model shapes for the cost model: from a Hugging Face `config.json` or a small built-in table.

Owns parameter counts, FLOPs per token and KV bytes per token, per tensor-parallel rank. Knows
nothing about time or hardware.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["BUILTIN_SHAPES", "ModelShape", "load_shape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2  # bf16 weights and KV

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def params_per_layer(self) -> int:
        """q, k, v, o projections and the SwiGLU MLP (norms are negligible)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * h * self.intermediate_size

    @property
    def num_body_params(self) -> int:
        """Parameters every token multiplies through (embedding lookup is not a matmul)."""
        return self.num_layers * self.params_per_layer

    @property
    def num_lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def num_params(self) -> int:
        embed = self.hidden_size * self.vocab_size
        return self.num_body_params + embed + (0 if self.tie_embeddings else embed)

    def weight_bytes(self, tp: int) -> float:
        """Bytes of weights one tensor-parallel rank holds (and reads once per step)."""
        return self.num_params * self.dtype_bytes / tp

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of every layer for one token, on one rank; KV heads are split over ranks
        but never below one head per rank (vLLM replicates them when tp > num_kv_heads)."""
        heads = max(1, -(-self.num_kv_heads // tp))
        return 2 * self.num_layers * heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, num_tokens: int, context_len: int) -> float:
        """QK^T and AV for `num_tokens` new tokens after `context_len` cached ones (causal)."""
        keys = num_tokens * context_len + num_tokens * (num_tokens + 1) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * keys


def _shape(
    name: str, h: int, layers: int, heads: int, kv: int, d: int, inter: int, vocab: int, tie: bool
) -> ModelShape:
    return ModelShape(
        name=name,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=d,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_embeddings=tie,
    )


# From each model's public config.json on its Hugging Face model card.
BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _shape("SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152, True),
        _shape("Qwen3-8B", 4096, 36, 32, 8, 128, 12288, 151936, False),
        # Llama-3.1-8B's config.json (Meta-Llama-3-8B has the same shape).
        _shape("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256, False),
        _shape("Qwen3-32B", 5120, 64, 64, 8, 128, 25600, 151936, False),
        _shape("Llama-3-70B", 8192, 80, 64, 8, 128, 28672, 128256, False),
    )
}


# The checkpoint's dtype sets weight and KV bytes (the engine serves in it unless told not to).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _from_hf_config(path: Path) -> ModelShape:
    raw = json.loads(path.read_text())
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelShape(
        name=path.parent.name,
        hidden_size=hidden,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype_bytes=_DTYPE_BYTES.get(str(raw.get("dtype") or raw.get("torch_dtype")), 2),
    )


def load_shape(model: str) -> ModelShape:
    """A built-in name (case-insensitive), a config.json, or a model directory holding one."""
    for name, shape in BUILTIN_SHAPES.items():
        if name.lower() == model.lower():
            return replace(shape)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = ", ".join(BUILTIN_SHAPES)
        raise ValueError(f"model {model!r}: not built in ({known}) and no config.json there")
    return _from_hf_config(path)
