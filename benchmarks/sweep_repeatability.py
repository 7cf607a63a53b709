"""How much two runs of the same real sweep differ: the noise floor any simulator's fidelity
is judged against. Prints, per (mode, rate, prompt length) point present in both, the relative
difference of median TTFT and median TPOT (B against A), then the median and worst.

    python benchmarks/sweep_repeatability.py A.json B.json [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METRICS = ("median_ttft_ms", "median_tpot_ms")


def compare(runs_a: list[dict], runs_b: list[dict]) -> list[dict]:
    key = lambda r: (r["mode"], float(r["request_rate"]), int(r["input_len"]))  # noqa: E731
    by_key = {key(r): r for r in runs_a}
    rows = []
    for b in runs_b:
        a = by_key.get(key(b))
        for metric in METRICS if a else ():
            row = dict(zip(("mode", "request_rate", "input_len"), key(b), strict=True))
            rows.append(row | {"metric": metric, "a": a[metric], "b": b[metric],
                               "difference": a[metric] / b[metric] - 1})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    args = parser.parse_args()
    rows = compare(json.loads(Path(args.a).read_text()), json.loads(Path(args.b).read_text()))
    if not rows:
        raise SystemExit("error: the two sweeps share no (mode, rate, input length) point")
    diffs = [abs(r["difference"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["difference"]))
    for r in rows:
        print(f"{r['mode']:12} {r['request_rate']:>4} {r['input_len']:>5} {r['metric']:15} "
              f"{r['a']:9.1f} {r['b']:9.1f} {r['difference']:+.0%}")  # fmt: skip
    print(
        f"median |difference| {statistics.median(diffs):.1%}; worst {abs(worst['difference']):.0%}"
        f" ({worst['mode']}, {worst['request_rate']} req/s, {worst['input_len']} tokens, "
        f"{worst['metric']}); {sum(d <= 0.3 for d in diffs)}/{len(diffs)} within 30%"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
