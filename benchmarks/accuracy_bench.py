"""bf16 accuracy of the default model, ours against transformers', both held to fp32, on this
CPU's native oneDNN path and with oneDNN capped below it (another bf16 kernel family: AMX ->
AVX512-BF16 -> emulated bf16), so every bf16 path this CPU has is measured on one machine.

The measurement is the one tests/engine/test_bf16_accuracy.py asserts on, run here for its
figures: 24 prompts (chat and plain text), 6 positions each, teacher-forced on a fixed text (our
fp32 greedy continuation, which test_equivalence pins to transformers'); at each position, does
the bf16 argmax equal transformers-fp32's, how far below fp32's best is our pick, and the mean
KL(fp32 || bf16). Each capped run is a process of its own (oneDNN reads its cap once).

    python benchmarks/accuracy_bench.py [--out docs/results/accuracy.json]

Prints a markdown table; the last stdout line is the JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the measurement lives with the test that asserts on it

import torch  # noqa: E402

from disagg.bench.host import cpu_info  # noqa: E402
from disagg.engine.checkpoint import resolve_model  # noqa: E402
from tests.engine import test_bf16_accuracy as accuracy  # noqa: E402

CAPS = (None, "AVX512_CORE_AMX", "AVX512_CORE_BF16", "AVX512_CORE", "AVX2")


def run(model: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model_dir = resolve_model(model)
    reference = accuracy.fp32_reference(model_dir)
    rows: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    with tempfile.TemporaryDirectory() as scratch:
        for cap in CAPS:
            isa = accuracy._onednn_isa(cap)
            if isa in seen:  # this CPU runs below the cap already: the same kernels again
                continue
            seen.add(isa)
            if cap is None:
                stats = accuracy.bf16_agreement(model_dir, reference)
            else:
                path = Path(scratch) / "fp32.pt"
                stats = accuracy._agreement_in_process_of_its_own(model_dir, reference, cap, path)
            rows[isa.strip()] = {"cap": cap or "none (native)", **stats}
    return {"cpu": cpu_info(), "model": model, "threads": 1, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| oneDNN ISA (cap) | positions | top-1 = fp32: transformers bf16 | ours bf16 | "
        "mean KL(fp32 ‖ bf16): transformers | ours | our worst pick, nats below fp32's best |",
        "|---|---|---|---|---|---|---|",
    ]
    for isa, r in result["rows"].items():
        lines.append(
            f"| {isa} ({r['cap']}) | {r['num_positions']} | {r['hf_bf16_agree']} | "
            f"{r['ours_agree']} | {r['hf_bf16_mean_kl']:.4f} | {r['ours_mean_kl']:.4f} | "
            f"{r['ours_worst_gap_nats']:.2f} |"
        )
    cpu = result["cpu"]
    lines.append(f"\nCPU: {cpu['model']}, {' '.join(cpu['flags_shown'])}; model {result['model']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = run(args.model)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
