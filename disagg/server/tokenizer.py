"""Text <-> token ids for one model directory, and the chat template, without `transformers`.

Owns reading tokenizer.json / tokenizer_config.json / chat_template.jinja, rendering the chat
template as Hugging Face does (sandboxed jinja2), and incremental detokenization for streaming.
Must not import torch or transformers: the server only needs the `tokenizers` library and jinja2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

# Names Hugging Face passes to the chat template (its `special_tokens_map`), when they are set.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete byte sequence
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output so leading spaces survive (Metaspace)


class Tokenizer:
    """A model's tokenizer: `tokenizers` backend + special tokens + chat template."""

    def __init__(
        self,
        backend: _Backend,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.special_tokens = dict(special_tokens)  # e.g. {"eos_token": "<|im_end|>"}
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1  # ids are valid in [0, vocab_size)
        eos = [vocab[t] for t in [special_tokens.get("eos_token")] if t in vocab]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        decoder = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, tok in decoder.items() if tok.special)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (tokenizer.json is required)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():  # the tokenizers library's own error names no file
            raise FileNotFoundError(
                f"{file}: no such file; a model directory needs config.json, tokenizer.json "
                "and its *.safetensors weights"
            )
        backend = _Backend.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json")
        special = _special_tokens(config) or _special_tokens(
            _read_json(path / "special_tokens_map.json")
        )
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template: str | None = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"))
        eos_ids = _generation_eos_ids(_read_json(path / "generation_config.json"))
        return cls(backend, special, template, eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it works (`encode` holds it: 2M characters
        # stalled every other thread for ~1.4 s); for one short text it costs ~1 us more.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` to the prompt text. ValueError: no template, or the template
        rejected the conversation (its `raise_exception`)."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        # As Hugging Face: keys whose value is None are dropped before rendering.
        clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=clean,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def detokenizer(
        self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals `decode(all ids)`.

    Window over the ids (the vLLM/TGI scheme):
        ids: [ ... | prefix ............ | read ........... ]
                    ^ prefix_offset       ^ read_offset     ^ len(ids)
    `ids[prefix:read]` is text already emitted (kept as context so decoders that strip a leading
    space or merge bytes see the same neighbours); text is emitted only when the decoded window
    does not end in U+FFFD, i.e. no multi-byte character is still incomplete.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop()  # a prompt ending mid-character would break the prefix property
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text ("" while a character is split)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is held back, even an invalid byte sequence."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        is_incomplete = new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= len(
            self._prefix_text
        )
        if is_incomplete and not final:
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    # Older configs store special tokens as serialized AddedToken objects {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    found = {name: _token_text(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
    return {name: text for name, text in found.items() if text is not None}


def _pick_template(raw: object) -> str | None:
    # A config may hold several named templates: [{"name": "default", "template": "..."}, ...].
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    return raw if isinstance(raw, str) else None


def _generation_eos_ids(config: Mapping[str, Any]) -> list[int]:
    raw = config.get("eos_token_id")
    ids = raw if isinstance(raw, list) else [raw]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # Hugging Face's environment: templates from the Hub are untrusted code, hence sandboxed.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
