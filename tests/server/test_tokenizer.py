"""Tokenizer against the transformers oracle, and the incremental detokenizer on split UTF-8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from disagg.server.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "Le café 東京 🙂🚀 xyz",
    " leading and  double  spaces\n\nnewlines",
    "<|im_start|>user\nhi<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France? 東京?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And 🚀?"},
]


def test_matches_transformers(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in TEXTS:
        for add_special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=add_special)
            assert ids == oracle.encode(text, add_special_tokens=add_special)
            for skip in (True, False):
                assert tokenizer.decode(ids, skip) == oracle.decode(ids, skip_special_tokens=skip)
    for add_prompt in (True, False):
        ours = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_prompt)
        theirs = oracle.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_prompt
        )
        assert ours == theirs
    assert tokenizer.vocab_size == len(oracle)
    assert tokenizer.eos_token_ids == (oracle.eos_token_id,)


def test_chat_template_vars_and_errors(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role forbidden"):
        tokenizer.apply_chat_template([{"role": "forbidden", "content": "x"}])


def test_template_file_and_generation_eos(tokenizer_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tokenizer_dir, copy)
    (copy / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_dir(copy)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    assert tok.eos_token_ids == (2, 0)  # tokenizer's eos first, then the generation config's


def test_no_template_is_value_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "a"}])


@pytest.mark.parametrize("text", TEXTS + ["東京🙂🚀", "é" * 7])
def test_incremental_detokenizer_never_emits_partial_chars(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The test corpus leaves CJK and emoji as byte tokens, so characters really are split.
    if any(ord(c) > 0x2000 for c in text):
        assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    prompt = tokenizer.encode("Paris is", add_special_tokens=True)
    detok = tokenizer.detokenizer(prompt)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_flush_returns_invalid_tail(tokenizer: Tokenizer) -> None:
    first_byte_of_emoji = tokenizer.encode("🙂", add_special_tokens=False)[0]
    detok = tokenizer.detokenizer()
    assert detok.add(first_byte_of_emoji) == ""  # incomplete: held back
    assert detok.flush() == "\ufffd"  # the request ended: decode() says the same
