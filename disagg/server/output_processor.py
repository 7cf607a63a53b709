"""Engine token deltas -> text deltas for one request: incremental detokenization and stop strings.

Owns the OpenAI stop-string semantics (the stop string is not returned; text that could still
become a stop string is held back until it cannot). Must not talk to the engine or to HTTP: the
handler reads `stop_string_hit` and aborts the engine request itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from disagg.protocol import FinishReason, RequestOutput
from disagg.tokenizer import Tokenizer

__all__ = ["OutputProcessor", "TextDelta"]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one engine output means for the client."""

    text: str  # new text safe to send; never part of a stop string
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
    stop_string_hit: bool = False  # finished by a stop string: the engine does not know yet
    error: str | None = None  # why, when finish_reason == "error"


class OutputProcessor:
    """Per-request state between the engine's token ids and the text sent to the client."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = tokenizer.detokenizer(prompt_token_ids, skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded, not yet released (may be the start of a stop string)
        self.text = ""  # everything released so far
        self.num_output_tokens = 0  # tokens consumed, up to the one completing a stop string
        self.finish_reason: str | None = None

    def process(self, output: RequestOutput) -> TextDelta:
        """Consume one engine delta. After a finished delta, further calls are a bug."""
        assert self.finish_reason is None, f"{output.request_id}: output after finish"
        for token_id in output.new_token_ids:
            self.num_output_tokens += 1
            self._pending += self._detokenizer.add(token_id)
            if (hit := self._release_through_stop()) is not None:
                return hit
        if not output.is_finished:
            return TextDelta(self._release(_held_suffix_len(self._pending, self._stop)), None)
        self._pending += self._detokenizer.flush()
        if (hit := self._release_through_stop()) is not None:
            return hit
        assert output.finish_reason is not None
        self.finish_reason = output.finish_reason.value
        text = self._release(0)
        error = output.error if output.finish_reason is FinishReason.ERROR else None
        return TextDelta(text, self.finish_reason, error=error)

    def _release_through_stop(self) -> TextDelta | None:
        index = _find_stop(self._pending, self._stop)
        if index is None:
            return None
        self._pending = self._pending[:index]
        self.finish_reason = FinishReason.STOP.value
        return TextDelta(self._release(0), self.finish_reason, stop_string_hit=True)

    def _release(self, num_held_chars: int) -> str:
        cut = len(self._pending) - num_held_chars
        text, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += text
        return text


def _find_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest stop string occurrence in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def _held_suffix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
