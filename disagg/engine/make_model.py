"""Random-weight Llama/Qwen2/Qwen3 checkpoints in Hugging Face layout, for tests and scaling runs.

Writes config.json, model.safetensors, generation_config.json and a byte-level BPE tokenizer
trained here on the Python standard library's sources (cached per vocabulary size). It must not
import transformers (an optional dependency); the written directory must load in transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from disagg.config import cache_dir
from disagg.engine.model_spec import ModelSpec

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "add_arguments", "run", "write_checkpoint"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
_ENDOFTEXT_ID, _IM_END_ID = 0, 2
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_CHARS_PER_TOKEN = 250  # training text per vocabulary entry: enough for BPE to fill the vocab
_LOGIT_STD = 4.0  # untied logits = lm_head @ unit-RMS hidden state; 4 gives a peaked softmax


def write_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "qwen3",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    rope_theta: float = 1e6,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a seeded random-weight checkpoint to `out_dir` and return it as a Path.

    Same arguments and seed -> byte-identical weights. Existing files in `out_dir` are replaced.
    """
    _check_args(arch, dtype, vocab_size, hidden_size, num_heads, head_dim)
    shape = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
    }
    config = _config(arch, shape, rope_theta, tie_word_embeddings, dtype)
    spec = ModelSpec.from_config(config)  # validates the config the way every reader will see it
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config())
    _write_weights(out / "model.safetensors", _random_weights(spec, seed), getattr(torch, dtype))
    (out / "tokenizer.json").write_text(_cached_tokenizer(vocab_size).read_text())
    _write_json(out / "tokenizer_config.json", _tokenizer_config(max_position_embeddings))
    return out


def _check_args(
    arch: str, dtype: str, vocab_size: int, hidden_size: int, num_heads: int, head_dim: int | None
) -> None:
    if arch not in _ARCH_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_ARCH_CLASSES)}, got {arch!r}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    # transformers' LlamaConfig insists on divisibility even with an explicit head_dim.
    if (head_dim is None or arch == "llama") and hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} must be a multiple of num_heads {num_heads}")
    if (head_dim or hidden_size // num_heads) % 2:
        raise ValueError(
            f"head_dim must be even for RoPE, got {head_dim or hidden_size // num_heads}"
        )


def _config(
    arch: str, shape: dict[str, int], rope_theta: float, tie_word_embeddings: bool, dtype: str
) -> dict[str, Any]:
    """config.json as transformers writes it for `arch`; `shape` holds the HF size keys."""
    config: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES[arch]],
        "model_type": arch,
        **shape,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        # Both spellings: transformers 4 reads rope_theta, 5 reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": None,
        "eos_token_id": [_IM_END_ID, _ENDOFTEXT_ID],
        "pad_token_id": _ENDOFTEXT_ID,
        "dtype": dtype,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch in ("qwen2", "qwen3"):
        num_layers = shape["num_hidden_layers"]
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    if arch != "qwen2":
        config.update(attention_bias=False)
    if arch == "llama":
        config.update(mlp_bias=False)
    return config


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": None,
        "eos_token_id": [_IM_END_ID, _ENDOFTEXT_ID],
        "pad_token_id": _ENDOFTEXT_ID,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- weights


def _random_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors, drawn in a fixed order from one seeded generator.

    Every linear is N(0, 1/fan_in), so each projection keeps unit RMS and every layer's
    attention and MLP add as much to the residual stream as the embedding itself: attention
    matters (a wrong KV cache changes tokens) and pre-norm keeps deep stacks healthy. An
    untied lm_head gives logits of std _LOGIT_STD: a peaked softmax, median greedy margin ~0.8.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = spec.hidden_size, spec.vocab_size
    # Tied: a token's own logit gets e . e = |e|^2, which at unit or lm_head scale dominates and
    # the model repeats its last token forever; at std 1/sqrt(hidden) (logit std ~1) the layers'
    # output decides instead.
    embed_std = 1.0 / math.sqrt(hidden) if spec.tie_word_embeddings else 1.0
    weights = {"model.embed_tokens.weight": _normal(gen, (vocab, hidden), embed_std)}
    for i in range(spec.num_layers):
        weights.update(_layer_weights(gen, spec, f"model.layers.{i}."))
    weights["model.norm.weight"] = torch.ones(hidden)
    if not spec.tie_word_embeddings:
        head_std = _LOGIT_STD / math.sqrt(hidden)
        weights["lm_head.weight"] = _normal(gen, (vocab, hidden), head_std)
    return weights


def _layer_weights(gen: torch.Generator, spec: ModelSpec, prefix: str) -> dict[str, torch.Tensor]:
    hidden, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    shapes = {
        "self_attn.q_proj": (q_out, hidden),
        "self_attn.k_proj": (kv_out, hidden),
        "self_attn.v_proj": (kv_out, hidden),
        "self_attn.o_proj": (hidden, q_out),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        weights[f"{prefix}{name}.weight"] = _normal(gen, shape, 1.0 / math.sqrt(shape[1]))
    for name in ("q_proj", "k_proj", "v_proj") if spec.has_qkv_bias else ():
        bias_shape = (shapes[f"self_attn.{name}"][0],)
        weights[f"{prefix}self_attn.{name}.bias"] = _normal(gen, bias_shape, 0.1)
    weights[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
    weights[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    if spec.has_qk_norm:
        weights[f"{prefix}self_attn.q_norm.weight"] = torch.ones(d)
        weights[f"{prefix}self_attn.k_norm.weight"] = torch.ones(d)
    return weights


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _write_weights(path: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.to(dtype).contiguous() for k, v in weights.items()}, str(path), {"format": "pt"}
    )


# --------------------------------------------------------------------------- tokenizer


def _cached_tokenizer(vocab_size: int) -> Path:
    """tokenizer.json with exactly `vocab_size` ids, trained once per size and cached."""
    path = cache_dir() / "tokenizers" / f"bytelevel-bpe-{vocab_size}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        text = _train_tokenizer(vocab_size).to_str(pretty=True)
        # Concurrent writers produce the same file; the rename keeps readers from a partial one.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    return path


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_stdlib_text(vocab_size * _CHARS_PER_TOKEN), trainer)
    # The standard library may run out of merges for huge vocabularies: fill the rest so that
    # every id the model can emit decodes to something.
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_tokens([AddedToken(f"<|extra_{i}|>", normalized=False) for i in range(missing)])
    assert tokenizer.get_vocab_size() == vocab_size, "tokenizer size differs from vocab_size"
    return tokenizer


def _stdlib_text(max_chars: int) -> Iterator[str]:
    """Python standard library sources in a fixed order, up to about `max_chars` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    num_chars = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        num_chars += len(text)
        if num_chars >= max_chars:
            return


def _tokenizer_config(max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--arch", choices=sorted(_ARCH_CLASSES), default="qwen3", help="model family")
    add("--layers", type=int, default=2, help="decoder layers")
    add("--hidden", type=int, default=64, help="hidden size")
    add("--heads", type=int, default=4, help="query heads")
    add("--kv-heads", type=int, default=2, help="key/value heads")
    add("--head-dim", type=int, default=None, help="default: hidden / heads")
    add("--intermediate", type=int, default=128, help="MLP inner size")
    add("--vocab", type=int, default=2048, help="vocabulary size (tokenizer trained to match)")
    add("--max-pos", type=int, default=8192, help="max_position_embeddings")
    add("--rope-theta", type=float, default=1e6, help="RoPE base")
    add("--seed", type=int, default=0, help="seeds the random weights")
    add("--tie", action="store_true", help="tie lm_head to the embedding")
    add("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="weights")
    add("--out", required=True, help="output directory")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    out = write_checkpoint(
        args.out,
        arch=args.arch,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=args.max_pos,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie,
        seed=args.seed,
        dtype=args.dtype,
    )
    print(out)
    return 0
