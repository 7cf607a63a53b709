"""Sweep cluster start/stop against a fake `up` command, and a whole sweep end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from disagg.bench.sweep import Cluster, SweepConfig, cluster_command
from disagg.cli import main as cli_main
from disagg.cluster.processes import free_port
from tests.helpers import wait_until

FAKE_UP = [sys.executable, str(Path(__file__).with_name("fake_up.py"))]


def _is_alive(pid: int) -> bool:
    """False once the process is gone or a zombie (its parent may be gone too)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_dead(pid: int) -> None:
    wait_until(lambda: not _is_alive(pid), f"process {pid} is gone")


def _cluster(tmp_path: Path, *flags: str, stop_timeout_s: float = 10.0) -> Cluster:
    port = free_port()
    cmd = [*FAKE_UP, "--mode", "pull", "--port", str(port), "--record", str(tmp_path / "rec")]
    return Cluster([*cmd, *flags], port, tmp_path / "up.log", stop_timeout_s)


def test_cluster_command_line() -> None:
    cfg = SweepConfig(model="/m", up_command=("up",), up_args=("--device", "cpu"), num_decode=2)
    assert cluster_command(cfg, "push", 8123) == [
        "up", "--mode", "push", "--model", "/m", "--port", "8123",
        "--num-prefill", "1", "--num-decode", "2", "--device", "cpu",
    ]  # fmt: skip
    # The aggregated baseline gets all 1 + 2 instances.
    assert cluster_command(cfg, "aggregated", 1) == [
        "up", "--mode", "aggregated", "--model", "/m", "--port", "1",
        "--num-decode", "3", "--device", "cpu",
    ]  # fmt: skip
    default = cluster_command(SweepConfig(model="/m"), "pull", 1)
    assert default[:4] == [sys.executable, "-m", "disagg.cli", "up"]
    with pytest.raises(ValueError):
        SweepConfig(model="/m", modes=("pull", "fast"))


def test_cluster_healthy_then_sigterm_stops_it_and_its_child(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, "--spawn-child", "--health-delay", "0.3")
    with cluster:
        cluster.wait_healthy(timeout_s=20)
        child_pid = json.loads((tmp_path / "rec").read_text())["child_pid"]
        assert _is_alive(child_pid)
    assert cluster.proc is not None and cluster.proc.returncode == 0  # graceful
    _wait_dead(child_pid)


def test_cluster_deaf_to_sigterm_is_killed_with_its_group(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, "--spawn-child", "--ignore-sigterm", stop_timeout_s=1.0)
    cluster.start()
    try:
        cluster.wait_healthy(timeout_s=20)
        child_pid = json.loads((tmp_path / "rec").read_text())["child_pid"]
    finally:
        assert cluster.stop() == -9
    _wait_dead(child_pid)


def test_cluster_never_healthy_times_out(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, "--never-healthy")
    with cluster, pytest.raises(RuntimeError, match="not healthy"):
        cluster.wait_healthy(timeout_s=1.0)
    assert cluster.proc is not None and cluster.proc.poll() is not None


def test_cluster_that_exits_reports_its_log(tmp_path: Path) -> None:
    cluster = Cluster([*FAKE_UP, "--port", "1"], 1, tmp_path / "up.log")  # no --record: exits 2
    with cluster, pytest.raises(RuntimeError, match="(?s)exited with code 2.*required: --record"):
        cluster.wait_healthy(timeout_s=20)


def test_sweep_end_to_end_with_fake_up(tmp_path: Path) -> None:
    out = tmp_path / "results"
    argv = ["bench", "sweep", "--model", "/models/tiny", "--modes", "aggregated,push"]
    argv += ["--request-rates", "100,200", "--input-lens", "8", "--output-len", "3"]
    argv += ["--num-prompts", "3", "--warmup", "1", "--output-dir", str(out)]
    argv += ["--up-command", " ".join(FAKE_UP), f"--up-args=--record {tmp_path / 'rec'}"]
    argv += ["--health-timeout", "30", "--stop-timeout", "10"]
    assert cli_main(argv) == 0
    runs = json.loads((out / "sweep.json").read_text())
    assert [(r["mode"], r["request_rate"]) for r in runs] == [
        ("aggregated", 100.0), ("aggregated", 200.0), ("push", 100.0), ("push", 200.0),
    ]  # fmt: skip
    for r in runs:
        assert (r["input_len"], r["output_len"], r["completed"]) == (8, 3, 3)
        assert r["output_lens"] == [3, 3, 3] and r["median_ttft_ms"] > 0
        assert r["mean_breakdown_ms"]["prefill"] == pytest.approx(4.0)
    assert runs[0]["warmup"] == 1 and runs[1]["warmup"] == 0  # once per cluster
    argv_seen = json.loads((tmp_path / "rec").read_text())["argv"]  # the last cluster: push
    assert argv_seen[:6] == ["--mode", "push", "--model", "/models/tiny", "--port", argv_seen[5]]
    assert argv_seen[6:] == [
        "--num-prefill",
        "1",
        "--num-decode",
        "1",
        "--record",
        str(tmp_path / "rec"),
    ]
    assert (out / "sweep.md").read_text().count("| push |") == 4
    assert (out / "ttft_tpot_vs_rate_in8.png").is_file() and (out / "ttft_breakdown.png").is_file()
    assert (out / "logs" / "up-push.log").is_file()
