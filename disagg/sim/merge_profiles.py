"""`python -m disagg.sim.merge_profiles A.toml B.toml C.toml --name cpu-dev --out X.toml`: one
CPU profile from several calibrations of the same machine, each figure their median.

A shared machine's speed drifts by tens of percent over an hour (two calibrations 15 minutes
apart timed a 4096-token prefill at 453 and 381 ms), so one calibration is one sample, like one
sweep. Calibrating at the hours the sweeps run and taking each figure's median treats the
profile's noise as the validation treats the sweeps'. Every input is a measured profile
(`disagg sim calibrate`); nothing here looks at a sweep.
"""

from __future__ import annotations

import argparse
import statistics
import tomllib
from pathlib import Path
from typing import Any

from disagg.sim.hardware import load_profile

__all__ = ["main", "merge"]


def merge(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric figure's median over `profiles` (they must hold the same keys); other
    values (booleans, names) must agree and are kept."""
    first = profiles[0]
    merged: dict[str, Any] = {}
    for key, value in first.items():
        values = [p[key] for p in profiles]
        if isinstance(value, dict):
            merged[key] = merge(values)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            merged[key] = statistics.median(values)
            if isinstance(value, int):
                merged[key] = int(round(merged[key]))
        else:
            if any(v != value for v in values):
                raise ValueError(f"profiles disagree on {key}: {values}")
            merged[key] = value
    return merged


def _toml(merged: dict[str, Any], sources: list[str]) -> str:
    lines = ["# A measured CPU profile: each figure the median of the calibrations",
             f"# {', '.join(sources)} (`disagg sim calibrate`, the same machine, hours apart).",
             f'name = "{merged["name"]}"']  # fmt: skip
    for section, values in merged.items():
        if not isinstance(values, dict):
            continue
        lines += ["", f"[{section}]"]
        for key, value in values.items():
            text = ("true" if value else "false") if isinstance(value, bool) else f"{value:.6g}"
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg.sim.merge_profiles", description=__doc__)
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    raw = [tomllib.loads(path.read_text()) for path in args.profiles]
    for profile in raw:
        profile["name"] = args.name
    args.out.write_text(_toml(merge(raw), [p.name for p in args.profiles]))
    load_profile(str(args.out))  # what was written must load
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
