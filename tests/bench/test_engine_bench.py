"""benchmarks/engine_bench.py runs end to end (tiny checkpoint, tiny sizes) and writes every row.

The figures themselves are not asserted (the machine is shared); the script must keep running,
cover every phase, and account for every requested serving token (it asserts that itself).
"""

from __future__ import annotations

from pathlib import Path

from tests.bench.scripts import run_bench_script


def test_engine_bench_writes_every_row(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine_bench.json"
    args = [
        "--model", str(tiny_qwen3_dir), "--threads", "1", "--new-tokens", "4", "--prompt-len", "8",
        "--repeats", "1", "--prefill-lens", "32", "--serving-requests", "5",
    ]  # fmt: skip
    result = run_bench_script("engine_bench.py", args, out, timeout_s=300)
    phases = [(row["phase"], row["size"]) for row in result["rows"]]
    assert phases == [("decode", 1), ("decode", 16), ("prefill", 32), ("serving", 16)]
    for row in result["rows"]:
        assert row["disagg_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio"] == row["disagg_tok_s"] / row["hf_tok_s"]
    decode = [row for row in result["rows"] if row["phase"] == "decode"]
    assert all(row["gemm_ceiling_tok_s"] > 0 for row in decode)
