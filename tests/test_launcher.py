"""`disagg up`: config merging and flags (pure), then real clusters of a tiny random model.

The cluster tests start real processes on loopback; every one is bounded by a timeout and killed
in a `finally`, and each ends by checking that no child process is left.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from disagg import cli
from disagg.cluster.config import (
    ClusterConfig,
    add_arguments,
    config_from_args,
    load_toml,
    merge_config,
)
from disagg.cluster.launcher import Cluster
from disagg.cluster.processes import free_ports
from disagg.engine.make_model import write_checkpoint
from tests.helpers import wait_until

# Small pool and context: the instances start in seconds and fit beside other test runs.
SERVE_ARGS = ("--num-blocks", "64", "--max-model-len", "512")
STARTUP_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    return write_checkpoint(out, num_layers=2, hidden_size=64)


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # loopback only: never through a proxy from the environment
    return session


def _is_running(pid: int) -> bool:
    """True unless /proc says the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _num_finished(session: requests.Session, instance_url: str) -> float:
    text = session.get(f"{instance_url}/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("disagg_requests_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _complete(session: requests.Session, url: str) -> requests.Response:
    body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    return session.post(f"{url}/v1/completions", json=body, timeout=30)


# ---- configuration ------------------------------------------------------------------------


def test_flags_win_over_file(tmp_path: Path) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(
        'mode = "pull"\nnum_prefill = 2\npolicy = "least_loaded"\nport = 9000\n'
        'serve_args = ["--block-size", "16"]\nprefill_args = ["--lease-s", "5"]\n'
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(toml), "--port", "0", "--", "--block-size", "32"])
    cfg = config_from_args(args)
    assert (cfg.mode, cfg.num_prefill_instances, cfg.num_decode) == ("pull", 2, 1)
    assert (cfg.policy, cfg.port) == ("least_loaded", 0)  # the flag beat the file's 9000
    cmd = cfg.serve_command("prefill", Path("m"), 1234)
    assert cmd[-6:] == ["--block-size", "16", "--block-size", "32", "--lease-s", "5"]
    assert ["--role", "prefill", "--kv-connector", "pull"] == cmd[cmd.index("--role") :][:4]
    route = cfg.route_command({"prefill": ["p0", "p1"], "decode": ["d0"]}, 9)
    assert route[route.index("--prefill") :] == ["--prefill", "p0", "p1", "--decode", "d0"]
    assert "--tokenizer" not in cfg.route_command({}, 9, Path("m"))  # only kv_aware needs it
    kv_aware = dataclasses.replace(cfg, policy="kv_aware").route_command({}, 9, Path("m"))
    assert kv_aware[kv_aware.index("--tokenizer") + 1] == "m"  # to match text prompts
    local = config_from_args(parser.parse_args(["--config", str(toml), "--policy", "kv_aware",
                                                "--local-prefill-tokens", "128"]))  # fmt: skip
    route = local.route_command({"prefill": ["p0"], "decode": ["d0"]}, 9)
    assert route[route.index("--local-prefill-tokens") + 1] == "128"
    routed_extra = dataclasses.replace(cfg, router_args=("--breaker-failures", "3"))
    assert routed_extra.route_command({}, 9)[-2:] == ["--breaker-failures", "3"]


def test_one_cluster_file_serves_both_backends(tmp_path: Path) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text('mode = "push"\nnum_decode = 2\nbackend = "ray"\nray_address = "h:6379"\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", str(toml)]))
    assert (cfg.backend, cfg.ray_address, cfg.mode, cfg.num_decode) == ("ray", "h:6379", "push", 2)
    local = config_from_args(parser.parse_args(["--config", str(toml), "--backend", "local"]))
    assert local.backend == "local" and local.serve_command("decode", Path("m"), 1) == (
        cfg.serve_command("decode", Path("m"), 1)
    )  # the same instances either way


def test_ray_backend_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.cluster import ray_backend

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(RuntimeError, match=re.escape("pip install 'disagg[ray]'")):
        ray_backend.import_ray()


def test_default_counts_per_mode() -> None:
    assert ClusterConfig().roles == (("both", 1),)
    assert ClusterConfig(mode="push").roles == (("prefill", 1), ("decode", 1))
    agg = ClusterConfig(num_decode=2).serve_command("both", Path("m"), 1)
    assert "--kv-connector" not in agg and "--kv-transport" not in agg


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"num_decode": "2"}, "num_decode must be an integer"),
        ({"num_prefill": 1}, "aggregated has no prefill"),
        ({"mode": "pull", "num_prefill": 0}, "needs num_prefill"),
        ({"serve_args": ("--port=1",)}, "must not set --port"),
        ({"kv_transport": "local"}, "kv_transport must be one of"),
    ],
)
def test_bad_config_values(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        merge_config(values, {})


def test_bad_flag_or_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["up", "--mode", "foo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'foo'" in capsys.readouterr().err
    toml = tmp_path / "bad.toml"
    toml.write_text('modes = "pull"\n')
    with pytest.raises(ValueError, match="unknown keys"):
        load_toml(toml)
    assert cli.main(["up", "--config", str(toml)]) == 2
    assert "unknown keys ['modes']" in capsys.readouterr().err


# ---- real clusters ------------------------------------------------------------------------


def test_up_aggregated_serves_then_stops_on_sigterm(tiny_model: Path, tmp_path: Path) -> None:
    port = free_ports(1)[0]
    out_path = tmp_path / "up.out"
    cmd = [sys.executable, "-m", "disagg.cli", "up", "--mode", "aggregated"]
    cmd += ["--model", str(tiny_model), "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    cmd += ["--startup-timeout-s", str(STARTUP_TIMEOUT_S), "--", *SERVE_ARGS]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # (1) ready line, then one completion through the router.
        wait_until(lambda: "disagg up ready on" in out_path.read_text(),
                   f"disagg up prints its ready line in {out_path.name}", 120)  # fmt: skip
        output = out_path.read_text()
        assert f"ready on http://127.0.0.1:{port} (mode aggregated: 1 instance(s)" in output
        session, url = _session(), f"http://127.0.0.1:{port}"
        resp = _complete(session, url)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        # (2) the router lists the one instance as healthy.
        rows = session.get(f"{url}/instances", timeout=5).json()
        assert [(r["role"], r["healthy"]) for r in rows] == [("both", True)]
        # (3) SIGTERM: exit 0, every child gone.
        pids = [int(p) for p in re.findall(r" pid (\d+) ", output)]
        assert len(pids) == 2  # one instance + the router
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, out_path.read_text()
        assert not [pid for pid in pids if _is_running(pid)]
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_cluster_api_round_robin_spreads_requests(tiny_model: Path, tmp_path: Path) -> None:
    cfg = ClusterConfig(
        num_decode=2,
        model=str(tiny_model),
        port=0,
        policy="round_robin",
        serve_args=SERVE_ARGS,
        log_dir=tmp_path,
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    cluster = Cluster(cfg)
    try:
        url = cluster.start()
        instance_urls = cluster.instance_urls["both"]
        assert len(instance_urls) == 2 and set(cluster.pids) == {"both-0", "both-1", "router"}
        session = _session()
        for _ in range(4):
            resp = _complete(session, url)
            assert resp.status_code == 200, resp.text
        assert [_num_finished(session, u) for u in instance_urls] == [2, 2]
    finally:
        cluster.stop()
    assert not [pid for pid in cluster.pids.values() if _is_running(pid)]
    assert cluster.dead_process() is not None  # stopped means exited, and it says so


def test_unresolvable_model_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["up", "--model", str(empty), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "cannot resolve model" in err and "without config.json" in err


def test_child_failing_at_startup_exits_1(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"  # config.json but no weights or tokenizer: serve dies loading
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model / "config.json").read_text())
    argv = ["up", "--model", str(broken), "--port", "0", "--log-dir", str(tmp_path / "logs")]
    assert cli.main([*argv, "--startup-timeout-s", str(STARTUP_TIMEOUT_S)]) == 1
    captured = capsys.readouterr()
    assert re.search(r"both-0 \(pid \d+\) exited with code 2 during startup", captured.err)
    assert "tokenizer.json: no such file" in captured.err  # the child's own error, from its log
    pids = [int(p) for p in re.findall(r" pid (\d+) ", captured.out)]
    assert pids and not [pid for pid in pids if _is_running(pid)]
    assert "router" not in captured.out  # never started: the instances were not healthy


def test_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"
    cfg = merge_config(load_toml(example), {})
    assert cfg.mode == "push" and cfg.num_prefill_instances == 2
    assert json.dumps(list(cfg.serve_args))  # plain strings, passed through as is
