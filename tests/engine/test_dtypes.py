"""`--dtype auto`: the choice per device and CPU, without needing that hardware."""

from __future__ import annotations

import pytest
import torch

from disagg.engine import dtypes


@pytest.mark.parametrize("asked", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept(asked: str) -> None:
    assert dtypes.resolve_dtype(asked, "cpu") == asked
    assert dtypes.resolve_dtype(asked, "cuda:0") == asked


@pytest.mark.parametrize("fast", [True, False])
def test_auto_on_cpu_follows_bf16_instructions(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_fast_bf16", lambda: fast)
    assert dtypes.resolve_dtype("auto", "cpu") == ("bfloat16" if fast else "float32")


@pytest.mark.parametrize(
    ("bf16_ok", "checkpoint", "expected"),
    [
        (True, "float32", "bfloat16"),  # an fp32 checkpoint still serves in half precision
        (True, "float16", "float16"),  # the checkpoint's own half type
        (True, "bfloat16", "bfloat16"),
        (False, "bfloat16", "float16"),  # a GPU without bf16
    ],
)
def test_auto_on_cuda(
    monkeypatch: pytest.MonkeyPatch, bf16_ok: bool, checkpoint: str, expected: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    assert dtypes.resolve_dtype("auto", "cuda", checkpoint) == expected


def test_cpu_flags_agree_with_proc_cpuinfo() -> None:
    """torch's probe and the kernel's flag list must tell the same story on this machine."""
    from_proc = bool({"avx512_bf16", "amx_bf16"} & dtypes.cpu_flags())
    assert dtypes.cpu_has_fast_bf16() == from_proc


def test_cpu_flags_fall_back_to_proc_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict:
        raise RuntimeError("no cpuinfo probe in this torch")

    monkeypatch.setattr(torch.cpu, "get_capabilities", broken)
    assert dtypes.cpu_has_fast_bf16() == bool({"avx512_bf16", "amx_bf16"} & dtypes.cpu_flags())
