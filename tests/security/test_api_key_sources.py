"""The clients' API key stays out of the process list.

An adversarial run read `--api-key KEY` from /proc/PID/cmdline of every instance and router:
any user of the host can. The key now also comes from a file (`--api-key-file`) or from
$DISAGG_API_KEY, for `disagg serve`, `disagg route` and `disagg up`, and `disagg up` hands it
to its children in their environment. `--api-key` still works, with a warning.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import requests

from disagg.cluster.config import ClusterConfig, config_from_args
from disagg.cluster.config import add_arguments as add_up_arguments
from disagg.cluster.launcher import Cluster
from disagg.config import API_KEY_ENV, resolve_api_key
from disagg.engine.make_model import write_checkpoint
from disagg.router import main as route_main
from disagg.server import main as serve_main

KEY = "sk-never-on-a-command-line-0123456789"


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-key"
    path.write_text(KEY + "\n")  # as `echo KEY > file` writes it
    return path


def _parse(add_arguments: object, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # type: ignore[operator]
    return parser.parse_args(list(argv))


# ---- where the key comes from ----------------------------------------------------------------


def test_flag_then_file_then_environment(
    key_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key("", None) == "from-env"
    assert resolve_api_key("", key_file) == KEY  # trailing newline dropped
    assert resolve_api_key("from-flag", None) == "from-flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key("", None) == ""  # open, as before
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("from-flag", key_file)
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_key("", tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key("", tmp_path / "empty")


def test_serve_takes_the_key_from_a_file_or_the_environment(
    key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server = serve_main.build_configs(_parse(serve_main.add_arguments, "--api-key-file",
                                                str(key_file)))  # fmt: skip
    assert server.api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    _, server = serve_main.build_configs(_parse(serve_main.add_arguments))
    assert server.api_key == "from-env"


def test_route_takes_the_key_from_a_file_or_the_environment(
    key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ("--decode", "http://127.0.0.1:9", "--api-key-file", str(key_file))
    assert route_main.build_config(_parse(route_main.add_arguments, *argv)).api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    cfg = route_main.build_config(_parse(route_main.add_arguments, "--decode", "http://h:9"))
    assert cfg.api_key == "from-env"


@pytest.mark.parametrize("command", ["serve", "route"])
def test_api_key_flag_warns_that_it_is_visible(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Still accepted; the run below stops at validation (exit 2), after the warning."""
    if command == "serve":
        args = _parse(serve_main.add_arguments, "--api-key", KEY, "--block-size", "3")
        assert serve_main.run(args) == 2
    else:
        args = _parse(route_main.add_arguments, "--api-key", KEY, "--mode", "pull",
                      "--decode", "http://h:9")  # fmt: skip
        assert route_main.run(args) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "process list" in err and "--api-key-file" in err
    assert KEY not in err


def test_both_sources_at_once_exit_2(key_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(serve_main.add_arguments, "--api-key", KEY, "--api-key-file", str(key_file))
    assert serve_main.run(args) == 2
    assert "not both" in capsys.readouterr().err


def test_up_flag_and_file_key(key_file: Path, tmp_path: Path) -> None:
    args = _parse(add_up_arguments, "--api-key-file", str(key_file))
    assert config_from_args(args).api_key_file == key_file
    toml = tmp_path / "cluster.toml"
    toml.write_text(f'api_key_file = "{key_file}"\n')
    assert (
        config_from_args(_parse(add_up_arguments, "--config", str(toml))).api_key_file == key_file
    )


# ---- a launched cluster ----------------------------------------------------------------------


@pytest.mark.slow
def test_up_keeps_the_key_off_every_child_command_line(key_file: Path, tmp_path: Path) -> None:
    """Regression: the key was readable in /proc/PID/cmdline. Now it travels in the children's
    environment (readable by their owner only), and both the router and the instances ask for
    it."""
    model = write_checkpoint(tmp_path / "tiny", num_layers=2, hidden_size=64)
    cfg = ClusterConfig(
        model=str(model), port=0, api_key_file=key_file, log_dir=tmp_path / "logs",
        serve_args=("--num-blocks", "64", "--max-model-len", "512"), startup_timeout_s=120.0,
    )  # fmt: skip
    cluster = Cluster(cfg)
    try:
        url = cluster.start()
        assert set(cluster.pids) == {"both-0", "router"}
        for name, pid in cluster.pids.items():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert KEY.encode() not in argv, name
            assert f"{API_KEY_ENV}={KEY}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
        session = requests.Session()
        session.trust_env = False  # loopback only
        body = {"prompt": "Hello", "max_tokens": 2}
        for base in (url, cluster.instance_urls["both"][0]):
            resp = session.post(f"{base}/v1/completions", json=body, timeout=30)
            assert resp.status_code == 401, (base, resp.text)
        auth = {"Authorization": f"Bearer {KEY}"}
        resp = session.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert resp.status_code == 200, resp.text
    finally:
        cluster.stop()
