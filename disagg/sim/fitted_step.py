"""The CPU step form: a sum of measured unit costs, fitted to timed engine steps.

A CPU is not a GPU roofline: its GEMMs, its attention kernel and its KV gather run at very
different rates and barely overlap, so a step is their sum:

    step_s = overhead + weights / memory bandwidth + per_request x requests
             + matmul FLOPs / matmul rate + prefill attention FLOPs / attention rate
             + KV bytes decodes read / KV read rate

`fit_step` finds the coefficients from timed steps (`disagg sim calibrate`) by non-negative
least squares on relative error. Pure numpy; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.sim.model_shape import ModelShape

__all__ = ["FittedStep", "StepFeatures", "StepSample", "fit_step", "step_features"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FittedStep:
    """Coefficients of the CPU step form (TOML section `[fitted_step]`)."""

    per_request_s: float  # per request in the batch (inputs, sampling, decode GEMM rows)
    matmul_flops_per_s: float  # projections + LM head, FLOP/s
    attention_flops_per_s: float  # prefill attention (QK^T and AV), FLOP/s
    kv_read_bytes_per_s: float  # KV a decode gathers and attends over, bytes/s

    def __post_init__(self) -> None:
        for name in ("matmul_flops_per_s", "attention_flops_per_s", "kv_read_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"fitted_step.{name} must be > 0, got {getattr(self, name)}")
        if self.per_request_s < 0:
            raise ValueError(f"fitted_step.per_request_s must be >= 0, got {self.per_request_s}")

    def variable_s(self, features: StepFeatures) -> float:
        """The step's time beyond the fixed overhead and the weight read."""
        return (
            features.num_requests * self.per_request_s
            + features.matmul_flops / self.matmul_flops_per_s
            + features.attention_flops / self.attention_flops_per_s
            + features.decode_kv_bytes / self.kv_read_bytes_per_s
        )


@dataclass(frozen=True, slots=True)
class StepFeatures:
    num_requests: int
    matmul_flops: float  # 2 x body params per computed token + 2 x LM head per sampled row
    attention_flops: float  # prefill chunks only: decode attention is a KV read
    decode_kv_bytes: float  # each decode's context plus its new token, one rank's bytes


@dataclass(frozen=True, slots=True)
class StepSample:
    """One timed step: what it computed and how long it took."""

    features: StepFeatures
    weight_bytes: float
    measured_s: float


def step_features(shape: ModelShape, batch: list[tuple[int, int, bool]]) -> StepFeatures:
    """`batch` items are (num_tokens, context_len, do_sample), as `cost.StepShape`."""
    matmul = attention = kv = 0.0
    kv_per_token = shape.kv_bytes_per_token()
    for num_tokens, context_len, do_sample in batch:
        matmul += 2.0 * shape.num_body_params * num_tokens
        if do_sample:
            matmul += 2.0 * shape.num_lm_head_params
        if num_tokens > 1:
            attention += shape.attention_flops(num_tokens, context_len)
        else:
            kv += (context_len + 1) * kv_per_token
    return StepFeatures(len(batch), matmul, attention, kv)


def _design(samples: list[StepSample], memory_bandwidth: float) -> tuple[np.ndarray, np.ndarray]:
    """Columns [1, requests, matmul, attention, kv] and the time left after the weight read,
    both divided by the measured time so the fit minimizes relative error."""
    rows = [
        [1.0, s.features.num_requests, s.features.matmul_flops]
        + [s.features.attention_flops, s.features.decode_kv_bytes]
        for s in samples
    ]
    x = np.asarray(rows, dtype=float)
    measured = np.asarray([s.measured_s for s in samples])
    y = measured - np.asarray([s.weight_bytes for s in samples]) / memory_bandwidth
    return x / measured[:, None], y / measured


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and refit
    (a handful of columns, so this simple active-set loop is enough)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        scale = np.abs(x[:, active]).max(axis=0)
        scale[scale == 0] = 1.0
        sol = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)[0] / scale
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit_step(samples: list[StepSample], memory_bandwidth: float) -> tuple[FittedStep, float]:
    """(coefficients, fixed overhead seconds) from timed steps. A rate whose column was never
    exercised (or fitted to zero cost) is reported as unbounded-but-finite: 1e30."""
    if len(samples) < 5:
        raise ValueError(f"need at least 5 timed steps to fit 5 coefficients, got {len(samples)}")
    x, y = _design(samples, memory_bandwidth)
    overhead, per_request, matmul, attention, kv = _nnls(x, y)

    def rate(cost: float) -> float:
        return 1.0 / cost if cost > 0 else 1e30

    fitted = FittedStep(
        per_request_s=float(per_request),
        matmul_flops_per_s=rate(matmul),
        attention_flops_per_s=rate(attention),
        kv_read_bytes_per_s=rate(kv),
    )
    return fitted, float(overhead)
