"""The cost model against step times computed by hand from the profile and the shape."""

from __future__ import annotations

import pytest

from disagg.sim.cost import CostModel, StepShape, count_runs
from disagg.sim.hardware import list_profiles, load_profile
from disagg.sim.model_shape import BUILTIN_SHAPES, load_shape


def _cost(tp: int = 1, layout: str = "ours") -> CostModel:
    return CostModel(load_shape("Qwen3-32B"), load_profile("h200-p5en"), tp, layout)  # type: ignore[arg-type]


def test_shapes_match_published_sizes() -> None:
    # Qwen3-32B is a 32.8B-parameter model; its KV is 64 layers x 8 heads x 128 x K/V x bf16.
    shape = BUILTIN_SHAPES["Qwen3-32B"]
    assert 32.5e9 < shape.num_params < 33.0e9
    assert shape.kv_bytes_per_token() == 64 * 8 * 128 * 2 * 2
    assert BUILTIN_SHAPES["Llama-3-70B"].num_params == pytest.approx(70.6e9, rel=0.01)
    assert 0.13e9 < BUILTIN_SHAPES["SmolLM2-135M"].num_params < 0.14e9


def test_decode_step_is_bandwidth_bound_by_hand() -> None:
    cost = _cost()
    hw, shape = cost.hardware, cost.shape
    step = cost.step_s([StepShape(num_tokens=1, context_len=1000, do_sample=True)])
    read = shape.num_params * 2 + 1001 * shape.kv_bytes_per_token()
    expected = read / (4.8e12 * 0.8) + hw.step_overhead_s
    assert step == pytest.approx(expected, rel=1e-9)


def test_prefill_step_is_compute_bound_by_hand() -> None:
    cost = _cost()
    shape = cost.shape
    n = 8192
    step = cost.step_s([StepShape(num_tokens=n, context_len=0, do_sample=True)])
    flops = 2 * shape.num_body_params * n + 2 * shape.num_lm_head_params
    flops += 4 * 64 * 64 * 128 * n * (n + 1) / 2
    assert step == pytest.approx(flops / (989e12 * 0.5) + cost.hardware.step_overhead_s)


def test_tensor_parallel_splits_compute_and_adds_allreduce() -> None:
    batch = [StepShape(num_tokens=4096, context_len=0, do_sample=False)]
    one, eight = _cost(1).step_s(batch), _cost(8).step_s(batch)
    assert one / 8 < eight < one / 4


def test_descriptor_counts_by_layout() -> None:
    assert count_runs([4, 5, 6, 9], [10, 11, 12, 13]) == 2  # 6->9 breaks the local run
    assert count_runs([1, 2, 3], [7, 9, 10]) == 2  # 7->9 breaks the remote run
    assert _cost(layout="ours").num_descriptors([1, 2, 3], [1, 2, 3]) == 1
    assert _cost(layout="vllm").num_descriptors([1, 2, 3], [1, 2, 3]) == 3 * 64 * 2


def test_transfer_and_setup_from_the_profile() -> None:
    cost = _cost(tp=8)
    assert cost.transfer_s(400e9) == pytest.approx(400e9 / (8 * 50e9 * 0.8))
    assert cost.setup_s(1000) == pytest.approx(1e-3 + 1000 * 1e-6)


def test_every_profile_loads() -> None:
    assert "h200-p5en" in list_profiles()
    for name in list_profiles():
        assert load_profile(name).peak_flops > 0


def test_model_from_hf_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,'
        ' "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000}'
    )
    shape = load_shape(str(tmp_path))
    assert shape.head_dim == 16 and shape.num_kv_heads == 2
    with pytest.raises(ValueError, match="not built in"):
        load_shape(str(tmp_path / "missing"))
