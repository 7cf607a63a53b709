"""What the benchmarks that measure a live local cluster share (stall_bench.py and
late_binding_bench.py): the mode presets, a streamed completion that records each token's
arrival time, an instance's loop-blocked histogram, the run's provenance (code version, load,
the model's vocabulary), number formatting and writing the JSON result. Imported by bare
name: benchmarks/ is on sys.path when a benchmark runs as a script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

__all__ = [
    "BLOCK_SIZE", "CLIENT_TIMEOUT", "MODES", "format_cell", "git_version", "loop_blocked",
    "provenance", "stream", "to_ms", "vocab_size", "write_result",
]  # fmt: skip

MODES: dict[str, dict[str, Any]] = {
    "pull-inline": {"mode": "pull", "pull_setup": "inline"},
    "pull-background": {"mode": "pull", "pull_setup": "background"},
    "push": {"mode": "push"},
    "aggregated": {"mode": "aggregated", "num_decode": 1},
}
BLOCK_SIZE = 16  # tokens per KV block (the serve default)
_METRIC = "disagg_kv_loop_blocked_seconds"
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=900)


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], times: list[float]
) -> dict[str, Any]:
    """POST a streamed completion; append each token chunk's arrival time to `times`.

    -> the final chunk's `disagg.breakdown`."""
    breakdown: dict[str, Any] = {}
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        buffer = b""
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            *events, buffer = (buffer + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                payload = event.decode().removeprefix("data:").strip()
                if payload == "[DONE]":
                    return breakdown
                data = json.loads(payload)
                if "error" in data:
                    raise RuntimeError(f"stream error: {json.dumps(data['error'])[:300]}")
                if data.get("choices") and data["choices"][0].get("text"):
                    times.append(now)
                breakdown = (data.get("disagg") or {}).get("breakdown", breakdown)
    return breakdown


async def loop_blocked(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(sum seconds, count) of an instance's loop-blocked histogram."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values = dict.fromkeys(("_sum", "_count"), 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(_METRIC) and name.removeprefix(_METRIC) in values:
            values[name.removeprefix(_METRIC)] = float(value)
    return values["_sum"], values["_count"]


def to_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def format_cell(value: float | None, width: int) -> str:
    text = "-" if value is None else f"{value:.3f}" if value < 1 else f"{value:.1f}"
    return f"{text:>{width}}"


def provenance(started: float, load_start: float) -> dict[str, Any]:
    """The run's argv, wall time, code version, cores and 1-min load at its start and end.

    `started` is time.perf_counter() and `load_start` os.getloadavg()[0], both at the start."""
    return {
        "argv": sys.argv,
        "wall_s": round(time.perf_counter() - started, 1),
        "git": git_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m_start_end": [load_start, os.getloadavg()[0]],
    }


def write_result(result: dict[str, Any], out: Path | None) -> None:
    """The JSON document to `out` (indented) when given, then as the last stdout line."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def vocab_size(model: str) -> int:
    from disagg.engine.checkpoint import resolve_model  # torch: only once we run

    return int(json.loads((resolve_model(model) / "config.json").read_text())["vocab_size"])


def git_version() -> str | None:
    """HEAD, with "-dirty" when disagg/ has uncommitted changes (the code this run measured)."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    try:
        head = subprocess.check_output([*git, "rev-parse", "--short", "HEAD"], text=True)
        dirty = subprocess.check_output([*git, "status", "--porcelain", "--", "disagg"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.strip() + ("-dirty" if dirty.strip() else "")
