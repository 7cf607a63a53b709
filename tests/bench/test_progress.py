"""The bench's progress: a redrawn bar on a terminal, whole lines on anything else."""

from __future__ import annotations

import io

from disagg.bench.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _show(stream: io.StringIO, total: int, *, is_shown: bool = True) -> str:
    progress = Progress(total, is_shown=is_shown, stream=stream)
    for _ in range(total):
        progress.update()
    progress.close()
    return stream.getvalue()


def test_off_a_terminal_one_line_per_tenth() -> None:
    lines = _show(io.StringIO(), 25).splitlines()
    counts = [int(line.split()[1].split("/")[0]) for line in lines]
    assert counts == [3, 5, 8, 10, 13, 15, 18, 20, 23, 25], lines
    assert all(line.startswith("bench: ") and "/25 requests done" in line for line in lines)
    assert _show(io.StringIO(), 3).count("\n") == 3  # fewer requests than tenths: one line each


def test_on_a_terminal_a_bar_and_when_hidden_nothing() -> None:
    assert "\r" in _show(_Terminal(), 5) and "5/5" in _show(_Terminal(), 5)
    assert _show(io.StringIO(), 5, is_shown=False) == _show(_Terminal(), 5, is_shown=False) == ""
