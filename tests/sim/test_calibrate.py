"""`disagg sim calibrate` end to end on a tiny grid: measures, fits, writes a loadable profile."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.sim.hardware import load_profile
from tests.sim.helpers import make_config, simulate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from disagg.engine.make_model import write_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return write_checkpoint(out, num_layers=1, hidden_size=64, vocab_size=512)


def test_tiny_calibration_writes_a_loadable_profile(checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "cpu-tiny.toml"
    argv = ["sim", "--model", str(checkpoint), "calibrate", "--name", "cpu-tiny"]
    argv += ["--out", str(path), "--transport", "local", "--repeats", "1"]
    argv += ["--serving-requests", "4"]
    argv += ["--prefill-lens", "16,64,128", "--prefill-contexts", "64"]
    argv += ["--decode-batches", "1,2,4", "--decode-contexts", "16,64"]
    assert main(argv) == 0
    text = path.read_text()
    assert "measured by disagg sim calibrate on" in text
    profile = load_profile(str(path))
    assert profile.fitted_step is not None and profile.http_hop_s > 0
    assert profile.output_token_s > 0
    assert profile.bandwidth_per_gpu > 0
    config = make_config("push", num_prompts=3, input_len=64, output_len=4, layout="ours")
    result, _ = simulate(replace(config, hardware=str(path), model=str(checkpoint)))
    assert result["completed"] == 3 and result["median_ttft_ms"] > 0
