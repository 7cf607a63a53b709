"""Random-weight checkpoints: load in transformers, generate non-degenerate text, write fast."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from disagg.engine.checkpoint import load_weights
from disagg.engine.make_model import CHAT_TEMPLATE, SPECIAL_TOKENS, write_checkpoint
from disagg.engine.model_spec import ModelSpec

torch.set_num_threads(1)

PROMPTS = ["Hello world", "def foo(x):\n    return", "import os\nimport sys"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_checkpoint_is_written_fast(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "warm")  # trains or reads the cached tokenizer
    start = time.monotonic()
    out = write_checkpoint(tmp_path / "m")
    assert time.monotonic() - start < 2.0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names


@pytest.mark.parametrize(
    ("arch", "tie", "head_dim"),
    [("qwen3", False, None), ("llama", False, None), ("qwen2", False, None), ("qwen3", True, 32)],
)
def test_transformers_loads_and_generates(
    tmp_path: Path, arch: str, tie: bool, head_dim: int | None
) -> None:
    out = write_checkpoint(tmp_path, arch=arch, tie_word_embeddings=tie, head_dim=head_dim)
    model, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert type(model).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    spec = ModelSpec.from_dir(out)
    assert model.config.head_dim == spec.head_dim == (head_dim or 64 // 4)
    assert model.model.rotary_emb.inv_freq[1].item() == pytest.approx(
        1e6 ** (-2 / spec.head_dim), rel=1e-5
    )
    hf_names = set(model.state_dict()) - ({"lm_head.weight"} if tie else set())
    assert set(load_weights(out, torch.float32, "cpu")) == hf_names
    tokenizer = AutoTokenizer.from_pretrained(out)
    replies = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        assert len(set(new.tolist())) >= 2, (prompt, new)  # not one token repeated
        replies.append(tuple(new.tolist()))
    assert len(set(replies)) == len(PROMPTS)


def test_attention_matters_and_margins_are_wide(tmp_path: Path) -> None:
    """Greedy tokens must depend on earlier tokens (else a broken KV cache would pass) and
    the top-2 logit gap must dwarf fp32 noise (else engine-vs-transformers checks flake)."""
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path), dtype=torch.float32)
    ids = torch.randint(3, 2048, (8, 24), generator=torch.Generator().manual_seed(0))
    edited = ids.clone()
    edited[:, 0] = (edited[:, 0] + 1) % 2048
    with torch.no_grad():
        logits = model(ids).logits[:, -1]
        edited_logits = model(edited).logits[:, -1]
    assert (logits.argmax(-1) != edited_logits.argmax(-1)).any()
    assert (logits - edited_logits).abs().amax() > 1.0
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.1
    assert 2.0 < logits.std() < 8.0


def test_seeded_and_deterministic(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "a", seed=3)
    b = write_checkpoint(tmp_path / "b", seed=3)
    c = write_checkpoint(tmp_path / "c", seed=4)
    assert _sha256(a / "model.safetensors") == _sha256(b / "model.safetensors")
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")


def test_shapes_dtype_and_config(tmp_path: Path) -> None:
    out = write_checkpoint(
        tmp_path, arch="llama", num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3,
        intermediate_size=160, vocab_size=1024, max_position_embeddings=512, rope_theta=1e5,
        dtype="bfloat16",
    )  # fmt: skip
    spec = ModelSpec.from_dir(out)
    assert (spec.architecture, spec.num_layers, spec.hidden_size) == ("llama", 3, 96)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (6, 3, 16)
    assert (spec.intermediate_size, spec.vocab_size, spec.max_position_embeddings) == (
        160,
        1024,
        512,
    )
    assert spec.rope_theta == 1e5 and spec.dtype == "bfloat16" and spec.bos_token_id is None
    weights = load_weights(out, torch.bfloat16, "cpu")
    assert weights["model.layers.2.self_attn.k_proj.weight"].shape == (3 * 16, 96)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (96, 160)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_tokenizer_round_trips_and_has_special_tokens(tmp_path: Path) -> None:
    out = write_checkpoint(tmp_path, vocab_size=1024)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 1024
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    text = "def f(x):\n    return x  # ünïcode ✓ 日本\t<|im_start|>user"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert 1 in ids  # the special token is one id, not spelled out
    assert len(ids) < len(text.encode())  # BPE merged something
    spec = ModelSpec.from_dir(out)
    assert spec.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>


def test_chat_template_renders(tmp_path: Path) -> None:
    out = write_checkpoint(tmp_path)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    expected += "<|im_start|>assistant\n"
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    rendered = jinja2.Template(config["chat_template"]).render(
        messages=chat, add_generation_prompt=True
    )
    assert rendered == expected
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == expected
    )
    assert tokenizer.eos_token == "<|im_end|>"


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        write_checkpoint(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="multiple of num_heads"):
        write_checkpoint(tmp_path, hidden_size=66, num_heads=4)
    with pytest.raises(ValueError, match="not a multiple"):
        write_checkpoint(tmp_path, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        write_checkpoint(tmp_path, vocab_size=100)


def test_cli_and_no_transformers_import(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from disagg.cli import main\n"
        f"argv = ['make-model', '--arch', 'llama', '--layers', '1', '--out', {str(tmp_path)!r}]\n"
        "rc = main(argv)\n"
        "assert rc == 0, rc\n"
        "print('transformers' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.split() == [str(tmp_path), "False"]
    assert ModelSpec.from_dir(tmp_path).architecture == "llama"
    assert ModelSpec.from_dir(tmp_path).num_layers == 1
