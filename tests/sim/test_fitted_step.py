"""The measured CPU step form: the fit, its monotonicity, profiles that carry it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from disagg.engine.outputs import ScheduledRequest, SchedulerOutput
from disagg.protocol import SamplingParams
from disagg.sim.calibrate import Calibration, format_profile
from disagg.sim.cost import CostModel, StepShape
from disagg.sim.fitted_step import FittedStep, StepSample, fit_step, step_features
from disagg.sim.hardware import load_profile
from disagg.sim.measure_serving import ServingFit
from disagg.sim.measure_transport import TransportFit
from disagg.sim.model_shape import BUILTIN_SHAPES, load_shape
from disagg.sim.runner import SimRunner
from tests.sim.helpers import make_config, simulate

_SHAPE = replace(BUILTIN_SHAPES["SmolLM2-135M"], dtype_bytes=4)
_TRUE = FittedStep(
    per_request_s=2e-4,
    matmul_flops_per_s=40e9,
    attention_flops_per_s=25e9,
    kv_read_bytes_per_s=3e9,
)
_BANDWIDTH = 15e9


def _batches() -> list[list[tuple[int, int, bool]]]:
    prefills = [[(n, ctx, True)] for n in (64, 256, 1024, 4096) for ctx in (0, 1024)]
    decodes = [[(1, c, True)] * b for b in (1, 8, 32) for c in (128, 4095)]
    return prefills + decodes


def _samples(overhead_s: float) -> list[StepSample]:
    weight_bytes = _SHAPE.weight_bytes(1)
    out = []
    for batch in _batches():
        features = step_features(_SHAPE, batch)
        seconds = overhead_s + weight_bytes / _BANDWIDTH + _TRUE.variable_s(features)
        out.append(StepSample(features, weight_bytes, seconds))
    return out


def _calibration(fitted: FittedStep = _TRUE) -> Calibration:
    transport = TransportFit("local", 65536, 5e-4, 2e-6, 4e9, 0.9, 8)
    return Calibration(
        name="cpu-test",
        date="2026-01-01",
        model="m",
        dtype="float32",
        fitted=fitted,
        step_overhead_s=1e-3,
        memory_bandwidth=_BANDWIDTH,
        fit_errors=[0.01],
        mixed_errors=[0.02],
        num_steps=14,
        transport=transport,
        serving=ServingFit(1e-3, 2e-4, 10, 2e-3, 9e-4, 7e-4),
    )


def test_fit_recovers_the_coefficients_that_made_the_times() -> None:
    fitted, overhead_s = fit_step(_samples(1.5e-3), _BANDWIDTH)
    assert overhead_s == pytest.approx(1.5e-3, rel=1e-6)
    assert fitted.per_request_s == pytest.approx(_TRUE.per_request_s, rel=1e-6)
    assert fitted.matmul_flops_per_s == pytest.approx(_TRUE.matmul_flops_per_s, rel=1e-6)
    assert fitted.attention_flops_per_s == pytest.approx(_TRUE.attention_flops_per_s, rel=1e-6)
    assert fitted.kv_read_bytes_per_s == pytest.approx(_TRUE.kv_read_bytes_per_s, rel=1e-6)


def test_fit_never_returns_a_negative_cost() -> None:
    samples = [replace(s, measured_s=s.measured_s * (1.3 if i % 2 else 0.8)) for i, s in
               enumerate(_samples(0.0))]  # fmt: skip
    fitted, overhead_s = fit_step(samples, _BANDWIDTH)
    assert overhead_s >= 0 and fitted.per_request_s >= 0


def test_profile_round_trip_gives_the_same_step_times(tmp_path: Path) -> None:
    path = tmp_path / "cpu-test.toml"
    path.write_text(format_profile(_calibration()))
    profile = load_profile(str(path))
    assert profile.fitted_step == _TRUE and profile.copy_in_post
    assert profile.setup_per_descriptor_s == pytest.approx(2e-6)
    assert profile.output_token_s == pytest.approx(2e-4)
    cost = CostModel(_SHAPE, profile)
    batch = [StepShape(512, 0, True), StepShape(1, 300, True)]
    items = [(s.num_tokens, s.context_len, s.do_sample) for s in batch]
    expected = 1e-3 + _SHAPE.weight_bytes(1) / _BANDWIDTH
    expected += _TRUE.variable_s(step_features(_SHAPE, items))
    assert cost.step_s(batch) == pytest.approx(expected, rel=1e-5)


def test_cpu_form_grows_with_tokens_context_and_batch(tmp_path: Path) -> None:
    path = tmp_path / "cpu-test.toml"
    path.write_text(format_profile(_calibration()))
    cost = CostModel(_SHAPE, load_profile(str(path)))
    prefill = [cost.step_s([StepShape(n, 0, True)]) for n in (16, 256, 1024, 4096)]
    chunked = [cost.step_s([StepShape(512, ctx, True)]) for ctx in (0, 512, 2048)]
    decode_ctx = [cost.step_s([StepShape(1, c, True)]) for c in (16, 1024, 4096)]
    decode_bs = [cost.step_s([StepShape(1, 512, True)] * b) for b in (1, 4, 16)]
    for series in (prefill, chunked, decode_ctx, decode_bs):
        assert series == sorted(series) and len(set(series)) == len(series)
    with pytest.raises(ValueError, match="tp=1"):
        CostModel(_SHAPE, load_profile(str(path)), tp=2)


def test_pull_copy_in_post_blocks_the_decode_loop(tmp_path: Path) -> None:
    """Where the transport copies inside post, a pull's READ is all loop time."""
    path = tmp_path / "cpu-test.toml"
    path.write_text(format_profile(_calibration()))
    kwargs = {"hardware": str(path), "model": "SmolLM2-135M", "layout": "ours"}
    result, _ = simulate(make_config("pull-inline", num_prompts=4, **kwargs))
    stages = result["mean_breakdown_ms"]
    assert stages["transfer"] == pytest.approx(0.0, abs=1e-9)
    assert stages["loop_blocked"] == pytest.approx(stages["handoff_setup"])
    assert stages["handoff_setup"] > 0


def test_checkpoint_dtype_sets_kv_and_weight_bytes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,'
        ' "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 256,'
        ' "vocab_size": 4096, "dtype": "float32"}'
    )
    assert load_shape(str(tmp_path)).kv_bytes_per_token() == 4096  # 4 KiB, as the sweep's model


def test_a_step_pays_serving_work_for_each_token_it_samples(tmp_path: Path) -> None:
    path = tmp_path / "cpu-test.toml"
    path.write_text(format_profile(_calibration()))
    cost = CostModel(_SHAPE, load_profile(str(path)))
    runner = SimRunner(cost)
    sampling = SamplingParams(max_tokens=4)
    chunk = ScheduledRequest("p", list(range(64)), 0, [0, 1, 2, 3], False, sampling, 0)
    decodes = [ScheduledRequest(f"d{i}", [5], 300, [9], True, sampling, 1) for i in range(3)]
    sched = SchedulerOutput(requests=[chunk, *decodes])
    batch = [StepShape(64, 0, False)] + [StepShape(1, 300, True)] * 3
    assert runner.duration_s(sched) == pytest.approx(cost.step_s(batch) + 3 * 2e-4)
