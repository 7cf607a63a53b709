"""Published GPU serving figures the simulator was not built from, predicted with spec-sheet
profiles only (h100-sxm, h200-p5en, a100-sxm-80gb: every figure a datasheet spec or an
ASSUMPTION shared by all three, none chosen after looking at these figures).

Each anchor names its source and the row it comes from (docs/results/gpu_anchors.md has the
quotes and caveats). Only anchors whose workload lengths are known are simulated: ShareGPT
runs whose lengths are not published are listed there and left out. The GPUStack Qwen3-8B runs
publish their ShareGPT totals (23,260 input, 22,061 output tokens over 100 prompts): the sim
replays 100 prompts of those mean lengths with a uniform spread of +-50% (an approximation of
ShareGPT's spread, said beside the result). Writes JSON and a markdown table; the last stdout
line is the JSON.

    python benchmarks/sim_gpu_anchors.py [--out docs/results/sim_gpu_anchors.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from disagg.bench.workload import WorkloadConfig
from disagg.sim.cluster import run_simulation
from disagg.sim.sim_config import SimConfig

_SOURCES = {
    "S1": "vLLM blog, The State of FP8 KV-Cache and Attention Quantization in vLLM "
          "(2026-04-22; vLLM 0.19.1, 1 x H100), https://vllm.ai/blog/fp8-kvcache",
    "S3": "GPUStack Performance Lab, Optimizing Qwen3-8B Latency on NVIDIA H100 GPUs (vLLM "
          "0.11.0, 1 x H100 SXM), https://github.com/gpustack/gpustack/blob/main/docs/"
          "performance-lab/qwen3-8b/h100-latency.md",
    "S4": "vLLM nightly performance benchmark on Buildkite (latency tests: batch 8, 32 in / "
          "128 out, dummy weights), https://buildkite.com/vllm/performance-benchmark/builds/"
          "9513 (H200) and /builds/9523 (A100)",
}  # fmt: skip


@dataclass(frozen=True)
class Anchor:
    name: str
    source: str
    model: str
    hardware: str
    tp: int
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None  # closed loop; None = the batch at once
    metrics: dict[str, float]  # bench key -> the published figure (ms)
    range_ratio: float = 0.0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


ANCHORS = [
    # S1: ITL at concurrency 1 as a fitted line over input length: 6.44 ms + 4.37e-5 ms x len.
    *(Anchor(f"H1 ITL at {n} input", "S1", "Llama-3.1-8B", "h100-sxm", 1, n, 128, 4, 1,
             {"median_itl_ms": 6.44 + 4.37e-5 * n},
             note="the post's fitted line at this input length, not a raw point")
      for n in (1024, 32768)),
    Anchor("H2 20k/2k, concurrency 8", "S1", "Llama-3.1-8B", "h100-sxm", 1, 20000, 2000, 48, 8,
           {"median_ttft_ms": 763.6, "median_itl_ms": 15.18}, range_ratio=0.15,
           note="150 requests published; 48 simulated (the same steady state)"),
    *(Anchor(f"H{6 + i} Qwen3-8B ShareGPT, concurrency {c}", "S3", "Qwen3-8B", "h100-sxm", 1,
             233, 221, 100, c, {"mean_ttft_ms": ttft, "mean_tpot_ms": tpot}, range_ratio=0.5,
             note="ShareGPT lengths replaced by their published means, +-50% uniform")
      for i, (c, ttft, tpot) in enumerate(
          [(1, 59.01, 7.28), (2, 63.78, 7.37), (4, 64.00, 7.38), (8, 74.57, 7.71)], start=1)),
    Anchor("G1 batch 8, Llama-3-8B", "S4", "Llama-3.1-8B", "h200-p5en", 1, 32, 128, 8, None,
           {"mean_e2el_ms": 834.06}),
    Anchor("G2 batch 8, Llama-3-70B TP4", "S4", "Llama-3-70B", "h200-p5en", 4, 32, 128, 8, None,
           {"mean_e2el_ms": 2075.08}),
    Anchor("A1 batch 8, Llama-3-8B", "S4", "Llama-3.1-8B", "a100-sxm-80gb", 1, 32, 128, 8, None,
           {"mean_e2el_ms": 1579.27}),
    Anchor("A2 batch 8, Llama-3-70B TP4", "S4", "Llama-3-70B", "a100-sxm-80gb", 4, 32, 128, 8,
           None, {"mean_e2el_ms": 3990.59}),
]  # fmt: skip


def predict(anchor: Anchor) -> dict[str, Any]:
    workload = WorkloadConfig(num_prompts=anchor.num_prompts, input_len=anchor.input_len,
                              output_len=anchor.output_len, range_ratio=anchor.range_ratio,
                              seed=0)  # fmt: skip
    config = SimConfig(mode="aggregated", num_prefill=1, num_decode=0, model=anchor.model,
                       hardware=anchor.hardware, tp=anchor.tp, workload=workload,
                       max_concurrency=anchor.max_concurrency)  # fmt: skip
    result, _ = run_simulation(replace(config, **anchor.extra))
    return result


def rows_of(anchor: Anchor, result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"anchor": anchor.name, "source": anchor.source, "model": anchor.model,
         "hardware": anchor.hardware, "tp": anchor.tp, "metric": metric, "published": value,
         "predicted": result[metric], "error": result[metric] / value - 1, "note": anchor.note}
        for metric, value in anchor.metrics.items()
    ]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| anchor | source | GPU (TP) | metric | published ms | predicted ms | error |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['anchor']} | {r['source']} | {r['hardware']} ({r['tp']}) "
                     f"| {r['metric']} | {r['published']:.1f} | {r['predicted']:.1f} "
                     f"| {r['error']:+.0%} |")  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    sources = sorted({r["source"] for r in rows})
    lines.append(f"\n{len(rows)} figures of {len({r['anchor'] for r in rows})} points from "
                 f"{len(sources)} sources ({', '.join(sources)}): median |error| "
                 f"{statistics.median(errors):.1%}, worst {max(errors):.1%}, "
                 f"{sum(e <= 0.25 for e in errors)} within 25%")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/sim_gpu_anchors.json"))
    args = parser.parse_args()
    rows = []
    for anchor in ANCHORS:
        rows += rows_of(anchor, predict(anchor))
    md = table(rows)
    print(md)
    doc = {"sources": _SOURCES, "rows": rows, "table": md}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
