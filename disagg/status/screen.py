"""Draw a `ClusterStatus` as the text `disagg status` shows. Pure: a snapshot in, a string out.

Two tables (load and handoffs; TTFT stage means) under a one-line router header, then the
problems that made a cell empty. Must not fetch anything nor touch the terminal (main.py does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from disagg.status.records import ClusterStatus, InstanceStatus, RouterStatus
from disagg.status.snapshot import STAGES

__all__ = ["format_table", "render"]

Style = Literal["plain", "heading", "alert"]
Line = tuple[str, Style]
EMPTY = "-"  # no value: the probe failed, or the stage is not on this instance's path
_ANSI = {"plain": ("", ""), "heading": ("\x1b[1;7m", "\x1b[0m"), "alert": ("\x1b[31m", "\x1b[0m")}
_NOT_ROUTED_MARK = "*"
_NOT_ROUTED_NOTE = f"{_NOT_ROUTED_MARK} answers, but the router does not send it requests (yet)"


def render(
    status: ClusterStatus,
    *,
    interval_s: float | None = None,
    width: int | None = None,
    height: int | None = None,
    color: bool = False,
) -> str:
    """The whole screen. `interval_s`: refresh period shown in the header (None: one shot);
    `width`/`height`: cut to the terminal's size (the live view must not scroll); `color`:
    ANSI bold/red and the quit key in the header (an interactive terminal only)."""
    header = _router_line(status, interval_s, is_interactive=color)
    lines = [header, ("", "plain"), *_tables(status), *_footnotes(status)]
    out = []
    for text, style in lines[:height]:
        text = text[:width] if width else text
        start, end = _ANSI[style] if color else ("", "")
        out.append(f"{start}{text}{end}" if text else text)
    return "\n".join(out)


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, num_left: int = 1
) -> list[str]:
    """Columns padded to their widest cell, two spaces apart; the first `num_left` columns
    left-aligned (names), the rest right-aligned (numbers)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.ljust(w) if i < num_left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    return [line(header), *(line(row) for row in rows)]


# ---- sections ------------------------------------------------------------------------------------


def _router_line(status: ClusterStatus, interval_s: float | None, *, is_interactive: bool) -> Line:
    router = status.router
    clock = time.strftime("%H:%M:%S", time.localtime(status.taken_at_s))
    refresh = f"every {interval_s:g}s" if interval_s else "one snapshot"
    refresh += ", q quits" if is_interactive else ""
    text = f"disagg status {clock} ({refresh})  router {_short(router.url)} "
    text += f"{router.health.upper()}  {_router_counts(router)}"
    return text, "alert" if router.health != "ok" else "heading"


def _router_counts(router: RouterStatus) -> str:
    if router.num_requests is None:
        return f"requests {EMPTY}"
    recomputed = _count(router.num_recomputed)
    return f"requests {router.num_requests} ({router.num_ok} ok, {recomputed} recomputed)"


_LOAD_HEADER = (
    "INSTANCE", "ROLE", "HEALTH", "KV", "RUN", "WAIT", "BLOCKS USED/TOTAL", "HANDOFFS",
    "KV FAILED", "EXPIRED", "DONE", "ERRORS",
)  # fmt: skip


def _tables(status: ClusterStatus) -> list[Line]:
    if not status.instances:
        why = "lists no instances" if status.router.is_reachable else "did not answer"
        return [(f"no instances to show: the router {why}", "alert")]
    return [
        *_load_table(status.instances),
        ("", "plain"),
        ("TTFT stage means in ms since each instance started (- = not on its path)", "plain"),
        *_stage_table(status.instances),
        ("", "plain"),
        ("Prompt tokens and KV since each instance started", "plain"),
        *_cache_table(status.instances),
    ]


def _load_table(instances: Sequence[InstanceStatus]) -> list[Line]:
    lines = format_table(_LOAD_HEADER, [_load_row(inst) for inst in instances], num_left=4)
    styles: list[Style] = ["plain", *(_style(inst) for inst in instances)]
    return list(zip(lines, styles, strict=True))


def _load_row(inst: InstanceStatus) -> list[str]:
    kv = "/".join(part for part in (inst.connector, inst.transport) if part) or EMPTY
    health = inst.health + (_NOT_ROUTED_MARK if inst.health == "ok" and not inst.is_routed else "")
    return [
        _short(inst.url), inst.role, health, kv, _count(inst.num_running),
        _count(inst.num_waiting), _blocks(inst), _count(inst.num_handoffs),
        _count(inst.num_kv_failures), _count(inst.num_expired), _count(inst.num_finished),
        _count(inst.num_errors),
    ]  # fmt: skip


def _stage_table(instances: Sequence[InstanceStatus]) -> list[Line]:
    header = ["INSTANCE", *STAGES, "TTFT", "LOOP BLOCKED"]
    rows = [
        [
            _short(inst.url),
            *(_ms(inst.stage_means_s.get(stage)) for stage in STAGES),
            _ms(inst.ttft_mean_s),
            _loop_blocked(inst),
        ]
        for inst in instances
    ]
    lines = format_table(header, rows)
    styles: list[Style] = ["plain", *(_style(inst) for inst in instances)]
    return list(zip(lines, styles, strict=True))


_CACHE_HEADER = ("INSTANCE", "PREFILLED", "CACHED", "HIT RATE", "REUSED ON DECODE", "KV MOVED")


def _cache_table(instances: Sequence[InstanceStatus]) -> list[Line]:
    rows = [
        [
            _short(inst.url), _count(inst.num_prefilled_tokens), _count(inst.num_cached_tokens),
            _percent(inst.cache_hit_fraction), _count(inst.num_reused_tokens),
            _bytes(inst.num_kv_bytes),
        ]
        for inst in instances
    ]  # fmt: skip
    lines = format_table(_CACHE_HEADER, rows)
    styles: list[Style] = ["plain", *(_style(inst) for inst in instances)]
    return list(zip(lines, styles, strict=True))


def _footnotes(status: ClusterStatus) -> list[Line]:
    lines: list[Line] = []
    if any(inst.health == "ok" and not inst.is_routed for inst in status.instances):
        lines.append((_NOT_ROUTED_NOTE, "plain"))
    problems = [(status.router.url, p) for p in status.router.problems]
    problems += [(inst.url, p) for inst in status.instances for p in inst.problems]
    if problems:
        lines.append(("problems:", "plain"))
        lines += [(f"  {_short(url)}  {problem}", "alert") for url, problem in problems]
    return [("", "plain"), *lines] if lines else []


# ---- cells ---------------------------------------------------------------------------------------


def _style(inst: InstanceStatus) -> Style:
    return "plain" if inst.health == "ok" else "alert"


def _short(url: str) -> str:
    return url.removeprefix("http://")


def _count(value: int | None) -> str:
    return EMPTY if value is None else str(value)


def _ms(seconds: float | None) -> str:
    return EMPTY if seconds is None else f"{seconds * 1e3:.1f}"


def _percent(fraction: float | None) -> str:
    return EMPTY if fraction is None else f"{fraction:.0%}"


def _bytes(num: int | None) -> str:
    return EMPTY if num is None else f"{num / 2**20:.1f} MiB"


def _blocks(inst: InstanceStatus) -> str:
    fraction = inst.blocks_used_fraction
    if inst.num_blocks_used is None or fraction is None:
        return EMPTY
    return f"{inst.num_blocks_used}/{inst.num_blocks_total} {fraction:4.0%}"


def _loop_blocked(inst: InstanceStatus) -> str:
    if inst.loop_blocked_s is None or inst.loop_blocked_mean_s is None:
        return EMPTY
    return f"{inst.loop_blocked_s:.3f}s ({inst.loop_blocked_mean_s * 1e3:.2f} ms each)"
