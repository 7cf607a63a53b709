"""Stop strings on detokenized text: truncation, hold-back, split across tokens, token counts."""

from __future__ import annotations

import random

from disagg.protocol import FinishReason, RequestOutput
from disagg.server.output_processor import OutputProcessor, TextDelta, _StopMatcher
from disagg.server.tokenizer import Tokenizer


def _feed(
    tokenizer: Tokenizer, text: str, stop: list[str], finish: FinishReason = FinishReason.LENGTH
) -> tuple[OutputProcessor, list[TextDelta]]:
    """Feed `text`'s tokens one per delta; the last delta carries `finish`."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer, tokenizer.encode("Q:"), stop)
    steps = []
    for i, token_id in enumerate(ids):
        is_last = i == len(ids) - 1
        steps.append(proc.process(RequestOutput("r", [token_id], finish if is_last else None)))
        if steps[-1].finish_reason is not None:
            break
    return proc, steps


def test_no_stop_concatenation_is_full_text(tokenizer: Tokenizer) -> None:
    proc, steps = _feed(tokenizer, "Hello 東京 world", [])
    assert "".join(s.text for s in steps) == "Hello 東京 world" == proc.text
    assert steps[-1].finish_reason == "length" and not steps[-1].stop_string_hit


def test_stop_string_truncates_and_counts_tokens(tokenizer: Tokenizer) -> None:
    text = "Paris is the capital of France. Le café"
    proc, steps = _feed(tokenizer, text, ["capital"])
    assert "".join(s.text for s in steps) == "Paris is the " == proc.text
    assert steps[-1].finish_reason == "stop" and steps[-1].stop_string_hit
    # Tokens consumed = those needed to see the whole stop string, not the whole script.
    needed = tokenizer.encode("Paris is the capital", add_special_tokens=False)
    total = tokenizer.encode(text, add_special_tokens=False)
    assert len(needed) <= proc.num_output_tokens < len(total)


def test_stop_string_split_across_tokens_is_held_back(tokenizer: Tokenizer) -> None:
    # "東京" is several byte tokens: the stop string completes over many deltas.
    proc, steps = _feed(tokenizer, "Tokyo 東京 is big", ["京 is"])
    assert "".join(s.text for s in steps) == "Tokyo 東"
    # No delta ever leaked a piece of the stop string.
    assert all("京" not in s.text for s in steps)
    assert steps[-1].stop_string_hit


def test_held_text_released_when_it_stops_matching(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer, [], ["the dog"])
    for token_id in tokenizer.encode("the", add_special_tokens=False):
        assert proc.process(RequestOutput("r", [token_id])).text == ""  # could start "the dog"
    for token_id in tokenizer.encode(" cat", add_special_tokens=False):
        proc.process(RequestOutput("r", [token_id]))
    assert proc.text == "the ca"  # the trailing "t" could still start "the dog"
    final = proc.process(RequestOutput("r", [], FinishReason.LENGTH))
    assert (final.text, proc.text, final.finish_reason) == ("t", "the cat", "length")


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    proc, _ = _feed(tokenizer, "one two three four", ["four", "two"])
    assert proc.text == "one "


def test_error_finish_carries_message(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer, [], [])
    out = RequestOutput("r", [], FinishReason.ERROR, error="transfer failed")
    step = proc.process(out)
    assert (step.finish_reason, step.error) == ("error", "transfer failed")


def test_stop_matcher_agrees_with_a_naive_scan() -> None:
    """Random texts over a two-letter alphabet, fed in random chunks, against random stop
    strings (overlapping prefixes are the hard case for an incremental matcher): the matcher's
    held length and earliest stop equal those of rescanning the whole text every time."""
    rng = random.Random(0)
    for _ in range(500):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(3)]
        matcher, text = _StopMatcher(stop), ""
        while len(text) < 40:
            chunk = "".join(rng.choice("ab") for _ in range(rng.randint(0, 4)))
            start = matcher.feed(chunk)
            text += chunk
            hits = [i for i in (text.find(s) for s in stop) if i >= 0]
            if hits:
                assert start == min(hits) - (len(text) - len(chunk)), (stop, text, chunk)
                break
            assert start is None
            assert matcher.num_held_chars == _naive_held(text, stop), (stop, text)


def _naive_held(text: str, stop: list[str]) -> int:
    """Longest end of `text` that is a proper prefix of some stop string."""
    return max((k for s in stop for k in range(len(s)) if text.endswith(s[:k])), default=0)
