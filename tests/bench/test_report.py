"""Sweep table and plots from a synthetic sweep.json; the single-run table."""

from __future__ import annotations

import asyncio
import json
import platform
from pathlib import Path

import pytest

from disagg.bench import report
from disagg.bench.host import describe_host
from disagg.bench.report import (
    breakdown_at_highest_load,
    format_sweep_markdown,
    format_table,
    to_json_line,
)
from disagg.bench.runner import BenchConfig, run_benchmark
from disagg.bench.workload import WorkloadConfig
from disagg.cli import main as cli_main
from tests.bench.fake_server import FakeBehavior, ThreadedServer

_STAGES = {
    "aggregated": {"queue": 5.0, "prefill": 40.0},
    "pull": {"queue": 5.0, "prefill": 40.0, "handoff_setup": 30.0, "transfer": 10.0},
    "push": {"queue": 5.0, "prefill": 40.0, "transfer": 10.0},
}


def _run(mode: str, rate: float, input_len: int) -> dict:
    ttft = {"aggregated": 50.0, "pull": 100.0, "push": 70.0}[mode] * rate * input_len / 128
    return {
        "mode": mode,
        "request_rate": rate,
        "input_len": input_len,
        "output_len": 16,
        "completed": 10,
        "failed": 0,
        "request_throughput": rate,
        "output_throughput": rate * 16,
        "request_goodput": None,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "mean_ttft_ms": ttft,
        "median_tpot_ms": 10.0 + rate,
        "p99_tpot_ms": 20.0 + rate,
        "median_itl_ms": 10.0,
        "median_e2el_ms": ttft + 150.0,
        "mean_breakdown_ms": dict(_STAGES[mode]),
    }


def _runs() -> list[dict]:
    return [
        _run(mode, rate, n)
        for mode in ("aggregated", "pull", "push")
        for n in (128, 256)
        for rate in (1.0, 2.0)
    ]


def test_markdown_has_one_row_per_run_and_breakdown_table() -> None:
    md = format_sweep_markdown(_runs())
    rows = [line for line in md.splitlines() if line.startswith("| pull |")]
    assert len(rows) == 4 + 4  # run table + breakdown table
    assert "| pull | 2.0 | 256 | 16 | 10/10 | 2.00 | 32.0 | 400.0 | 800.0 | 12.0 | 22.0 |" in md
    assert "| pull | 2.0 | 256 | 400.0 | 5.0 | 40.0 | 30.0 | 10.0 | - | - |" in md


def test_breakdown_at_highest_load_accounts_for_the_rest() -> None:
    rate, input_len, per_mode = breakdown_at_highest_load(_runs())
    assert (rate, input_len) == (2.0, 256)
    assert list(per_mode) == ["aggregated", "pull", "push"]
    assert per_mode["pull"] == pytest.approx(
        {"queue": 5.0, "prefill": 40.0, "handoff_setup": 30.0, "transfer": 10.0, "other": 315.0}
    )
    assert per_mode["aggregated"]["other"] == pytest.approx(200.0 - 45.0)


def test_plot_only_rerenders_from_sweep_json(tmp_path: Path, capsys) -> None:
    (tmp_path / "sweep.json").write_text(json.dumps(_runs()))
    assert cli_main(["bench", "sweep", "--plot-only", "--output-dir", str(tmp_path)]) == 0
    for name in (
        "ttft_tpot_vs_rate_in128.png",
        "ttft_tpot_vs_rate_in256.png",
        "ttft_breakdown.png",
    ):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "sweep.md").read_text() == format_sweep_markdown(_runs())
    assert "sweep.md" in capsys.readouterr().out
    missing = tmp_path / "none"
    assert cli_main(["bench", "sweep", "--plot-only", "--output-dir", str(missing)]) == 2


def test_single_run_table_and_json_line() -> None:
    result = {
        "completed": 3,
        "failed": 1,
        "max_concurrent_requests": 2,
        "duration": 2.0,
        "total_input_tokens": 60,
        "total_output_tokens": 9,
        "request_throughput": 1.5,
        "request_goodput": 0.5,
        "output_throughput": 4.5,
        "total_token_throughput": 34.5,
        "mean_breakdown_ms": {"queue": 20.0},
        "ttfts": [0.1],
        "errors": [""],
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        result.update(
            {f"mean_{metric}_ms": 1.0, f"median_{metric}_ms": 2.0, f"p99_{metric}_ms": 3.0}
        )
    table = format_table(result, (99.0,))
    assert "Request goodput (req/s):                0.50" in table
    assert "P99 TPOT (ms):                          3.00" in table
    assert "queue (ms):                             20.00" in table
    line = json.loads(to_json_line(result))
    assert line["completed"] == 3 and "ttfts" not in line and "errors" not in line


def test_failure_summary_names_each_distinct_error_with_its_count() -> None:
    from disagg.bench.report import failure_summary

    result = {"errors": ["", "HTTP 400: bad model", "", "HTTP 400: bad model", "Timeout: 600 s"]}
    assert failure_summary(result).splitlines() == [
        "3 request(s) failed:",
        "  2 x HTTP 400: bad model",
        "  1 x Timeout: 600 s",
    ]
    assert failure_summary({"errors": ["", ""]}) == ""


def test_plots_start_at_zero_and_bar_the_per_request_spread(tmp_path: Path, monkeypatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    runs = _runs()
    for run in runs:  # three requests per point: TTFTs around the median, TPOTs from E2ELs
        t = run["median_ttft_ms"] / 1e3
        run |= {"ttfts": [0.5 * t, t, 2 * t], "e2els": [t + 0.15] * 3, "output_lens": [16] * 3}
        run |= {"model_id": "/tmp/x/sweep-qwen3", "num_prompts": 3, "random_output_len": 16}
    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to inspect it
    report._plot_vs_rate(plt, runs, 128, tmp_path / "p.png")
    (figure,) = figures
    for ax in figure.axes:
        assert ax.get_ylim()[0] == 0
    ttft_bars = figure.axes[0].containers[0]  # aggregated: errorbar (line, caps, bars)
    segments = ttft_bars.lines[2][0].get_segments()
    assert len(segments) == 2 and all(seg[1][1] > seg[0][1] for seg in segments)
    assert "sweep-qwen3; 3 requests per point" in report.caption(runs)


def test_quartiles_of_a_point_without_per_request_values_are_zero() -> None:
    assert report._quartiles([], 5.0) == (0.0, 0.0)
    assert report._quartiles([1.0, 2.0, 3.0, 4.0, 5.0], 3.0) == (1.0, 1.0)


def _cpu_model() -> str:
    """The CPU's name as a user reads it: /proc/cpuinfo's `model name`, else platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def test_caption_names_the_machine_a_run_was_measured_on() -> None:
    """Regression: plot footers named the checkpoint ("ckpt-sweep") but not the machine."""
    workload = WorkloadConfig(num_prompts=2, input_len=8, output_len=2)
    with ThreadedServer(FakeBehavior()) as server:
        result = asyncio.run(
            run_benchmark(BenchConfig(base_url=server.base_url, workload=workload))
        )
    assert _cpu_model() and _cpu_model() in result["host"]
    run = {**result, "mode": "aggregated", "input_len": 8, "output_len": 2}
    assert f"host CPU {_cpu_model()}" in report.caption([run])
    assert f"host CPU {_cpu_model()}" in format_sweep_markdown([run]).splitlines()[0]
    assert "host" not in report.caption(_runs())  # results from before: no machine, none guessed


def test_host_names_the_cpu_and_each_gpu_model(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Fake CPU 9000 @ 3 GHz\n" * 2)
    assert describe_host(tmp_path) == "CPU Fake CPU 9000 @ 3 GHz"
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        gpu = tmp_path / "driver" / "nvidia" / "gpus" / bus
        gpu.mkdir(parents=True)
        (gpu / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   \t\t 17\n")
    assert describe_host(tmp_path) == "CPU Fake CPU 9000 @ 3 GHz, GPU 2 x NVIDIA H200"
