"""`disagg sim sweep` and `disagg sim validate`: grid points keyed as the bench sweep's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.sim.sweep import deployment
from disagg.sim.validate import compare, summarize
from tests.sim.helpers import make_config

_FLAGS = ["--model", "Qwen3-8B", "--num-blocks", "1024", "--num-prompts", "4", "--output-len", "8"]


def test_aggregated_baseline_gets_every_instance() -> None:
    config = deployment(make_config("pull", num_prefill=1, num_decode=2), "aggregated")
    assert (config.mode, config.num_instances, config.num_decode) == ("aggregated", 3, 0)


def test_sweep_writes_one_bench_keyed_entry_per_point(tmp_path: Path) -> None:
    out = tmp_path / "sim_sweep.json"
    argv = ["sim", *_FLAGS, "sweep", "--modes", "pull,push", "--request-rates", "1,4"]
    assert main([*argv, "--input-lens", "256", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())
    points = [(r["mode"], r["request_rate"], r["input_len"]) for r in runs]
    assert points == [(m, r, 256) for m in ("pull", "push") for r in (1.0, 4.0)]
    assert all(r["completed"] == 4 and "median_tpot_ms" in r and "ttfts" not in r for r in runs)


def test_sweep_plots_are_the_bench_sweeps_and_say_simulated(tmp_path: Path) -> None:
    from disagg.bench.report import _tag

    out, plots = tmp_path / "sim_sweep.json", tmp_path / "plots"
    argv = ["sim", *_FLAGS, "sweep", "--modes", "pull,push", "--request-rates", "1,4"]
    assert main([*argv, "--input-lens", "256", "--out", str(out), "--plot-dir", str(plots)]) == 0
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["ttft_breakdown.png", "ttft_tpot_vs_rate_in256.png"]
    runs = json.loads(out.read_text())
    assert _tag(runs) == ", SIMULATED"
    assert _tag([{**runs[0], "simulated": False}, *runs[1:]]) == ""  # a measured run: no tag


def test_validate_predicts_each_measured_point(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    sweep = tmp_path / "sim_sweep.json"
    argv = ["sim", *_FLAGS, "sweep", "--modes", "aggregated", "--request-rates", "2"]
    assert main([*argv, "--input-lens", "128", "--out", str(sweep), "--keep-per-request"]) == 0
    out = tmp_path / "validation.json"
    assert main(["sim", *_FLAGS, "validate", "--sweep", str(sweep), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["metric"] for r in rows] == ["median_ttft_ms", "median_tpot_ms"]
    for row in rows:  # the sim predicting its own run: same seed, same answer
        assert row["predicted"] == pytest.approx(row["measured"]) and row["error"] == 0
        assert row["in_band"] and row["num_runs"] == 1
    assert "| all | 2 | 0.0% | 0.0% | +0.0% | 2 | 2 |" in capsys.readouterr().out


def test_validate_takes_the_mean_and_band_of_several_sweeps(tmp_path: Path) -> None:
    """Two sweeps of one grid: each point is predicted once and compared with their mean; a
    prediction between the two runs is inside the band."""
    sweep = tmp_path / "a.json"
    argv = ["sim", *_FLAGS, "sweep", "--modes", "aggregated", "--request-rates", "2"]
    assert main([*argv, "--input-lens", "128", "--out", str(sweep), "--keep-per-request"]) == 0
    (run,) = json.loads(sweep.read_text())
    slower = {**run, "median_ttft_ms": run["median_ttft_ms"] * 3, "median_tpot_ms": 1e-3}
    (tmp_path / "b.json").write_text(json.dumps([slower]))
    out = tmp_path / "validation.json"
    argv = ["sim", *_FLAGS, "validate", "--sweep", str(sweep), str(tmp_path / "b.json")]
    assert main([*argv, "--out", str(out)]) == 0
    ttft, tpot = json.loads(out.read_text())
    assert ttft["num_runs"] == 2 and ttft["measured"] == pytest.approx(2 * run["median_ttft_ms"])
    assert ttft["error"] == pytest.approx(-0.5) and ttft["in_band"]
    assert ttft["spread_units"] == pytest.approx(-1.0)  # at the band's low end
    assert tpot["in_band"] and tpot["spread_units"] == pytest.approx(1.0)


def test_compare_and_summary_report_relative_error() -> None:
    measured = {"mode": "push", "request_rate": 1.0, "input_len": 64}
    measured |= {"median_ttft_ms": 100.0, "median_tpot_ms": 10.0, "mean_breakdown_ms": {"queue": 1}}
    predicted = {"median_ttft_ms": 120.0, "median_tpot_ms": 9.0, "mean_breakdown_ms": {}}
    rows = compare([measured], predicted)
    assert [round(r["error"], 6) for r in rows] == [0.2, -0.1]
    assert rows[0]["stages_measured_ms"] == {"queue": 1}
    assert not rows[0]["in_band"] and rows[0]["spread_units"] is None  # one run: no spread
    assert "| push | 2 | 15.0% | 20.0% | +5.0% | 2 | 0 |" in summarize(rows)


def test_compare_gives_the_stages_mean_over_runs_like_the_figures() -> None:
    """The measured stages of a TTFT row are the runs' mean, as its `measured` is: one
    sweep's breakdown beside several sweeps' mean would not add up."""
    point = {"mode": "pull", "request_rate": 1.0, "input_len": 64, "median_tpot_ms": 10.0}
    runs = [
        point | {"median_ttft_ms": 100.0, "mean_breakdown_ms": {"queue": 1.0, "prefill": 90.0}},
        point | {"median_ttft_ms": 140.0, "mean_breakdown_ms": {"queue": 3.0}},
    ]
    predicted = {"median_ttft_ms": 120.0, "median_tpot_ms": 10.0, "mean_breakdown_ms": {}}
    ttft = compare(runs, predicted)[0]
    assert ttft["measured"] == pytest.approx(120.0)
    assert ttft["stages_measured_ms"] == {"queue": 2.0, "prefill": 90.0}
