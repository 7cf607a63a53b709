"""`ModelSpec`: the architecture facts of a Llama/Qwen2/Qwen3-family checkpoint, from its
config.json (and generation_config.json's EOS ids). Every other engine module reads the
architecture from here. Pure: JSON in, a frozen dataclass out; no torch, no weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelSpec"]

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# transformers' config defaults for keys a config.json may omit (they differ per family).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Architecture facts of a Llama/Qwen2/Qwen3-family checkpoint, parsed from its config.json.

    Everything the model, the runner and the KV cache need; nothing else is read from the config.
    """

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU inner width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); divides num_heads
    head_dim: int  # may differ from hidden_size // num_heads (Qwen3)
    rms_norm_eps: float
    rope_theta: float  # RoPE base; SmolLM2 uses 1e5, Qwen3 1e6
    # None = plain RoPE; else has "rope_type". Read-only; left out of the hash (dicts have none).
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool  # lm_head shares embed_tokens' weight
    has_qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    has_qkv_bias: bool  # bias on q_proj, k_proj, v_proj
    has_o_bias: bool  # bias on o_proj (llama/qwen3 `attention_bias`; never for qwen2)
    eos_token_ids: tuple[int, ...]  # config.json and generation_config.json, deduplicated
    bos_token_id: int | None
    dtype: str  # dtype the weights were saved in, e.g. "float32", "bfloat16"

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        """Parse `path`/config.json, adding EOS ids from generation_config.json when present."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen_config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_config(config, gen_config.get("eos_token_id"))

    @classmethod
    def from_config(
        cls, config: dict[str, Any], extra_eos: int | list[int] | None = None
    ) -> ModelSpec:
        """Parse a config.json dict; ValueError for architectures or features we do not run."""
        arch = _architecture(config)
        # Defaults fill absent keys only: an explicit null (e.g. bos_token_id) stays null.
        cfg = {**_DEFAULTS[arch], **config}
        _check_supported(cfg)
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} not a multiple of kv heads {num_kv_heads}"
            )
        max_pos = int(cfg["max_position_embeddings"])
        rope_theta, rope_scaling = _rope(cfg, max_pos)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
            has_qk_norm=arch == "qwen3",
            has_qkv_bias=arch == "qwen2" or attention_bias,
            has_o_bias=arch != "qwen2" and attention_bias,
            eos_token_ids=_token_ids(cfg.get("eos_token_id"), extra_eos),
            bos_token_id=cfg.get("bos_token_id"),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def _architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    model_type = config.get("model_type")
    if not names and model_type in _DEFAULTS:
        return str(model_type)
    supported = ", ".join(sorted(_ARCHITECTURES))
    raise ValueError(
        f"unsupported architecture {names or None} (model_type {model_type!r}); "
        f"supported: {supported}"
    )


def _check_supported(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act must be silu, got {act!r}")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")


def _rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)

    Mirrors transformers' precedence: a legacy `rope_scaling` wins over `rope_parameters`; the
    theta inside the dict wins over a top-level `rope_theta`.
    """
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or _DEFAULT_ROPE_THETA)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {_ROPE_TYPES}")
    factor = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if factor != 1.0:
        raise ValueError(f"partial_rotary_factor must be 1.0, got {factor}")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        # Same fallback as transformers: a top-level value wins, then max_position_embeddings.
        original = cfg.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(
            original or params.get("original_max_position_embeddings") or max_pos
        )
    return theta, {"rope_type": rope_type, **params}


def _token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else value or []:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)
