"""`disagg sim --model CKPT calibrate`: measure this machine, write a CPU hardware profile.

Micro-measurements only (never an end-to-end run): the engine's `ModelRunner.execute` over a
grid of batch shapes, the scheduler's schedule+update, one thread's memory bandwidth, the KV
transport's per-transfer, per-descriptor and per-byte cost, and the serving path around the
engine (`measure_serving.py`: router and instance as processes, a 1-layer model). The step times are
fitted to the sum form of `fitted_step.py`; every figure in the TOML says when and what was
timed. torch and aiohttp are imported here, lazily, never by the simulator itself.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from disagg.sim.fitted_step import FittedStep, StepSample, fit_step
from disagg.sim.hardware import load_profile
from disagg.sim.model_shape import ModelShape, load_shape

__all__ = ["Calibration", "add_arguments", "calibrate", "format_profile", "main", "run"]

_PROFILE_DIR = Path(__file__).parent / "hardware"


@dataclass(frozen=True, slots=True)
class Calibration:
    """Everything measured, ready to write as a profile."""

    name: str
    date: str
    model: str
    dtype: str
    fitted: FittedStep
    step_overhead_s: float
    memory_bandwidth: float
    fit_errors: list[float]  # relative error of the fit on each timed step
    mixed_errors: list[float]  # relative error on held-out prefill+decode steps
    num_steps: int
    transport: Any  # measure_transport.TransportFit
    serving: Any  # measure_serving.ServingFit: the HTTP hop and per-token serving work
    scheduler_s: tuple[float, float] = (0.0, 0.0)  # Scheduler.schedule+update: fixed, per request
    steps: tuple[tuple[str, float, float], ...] = ()  # (shape, measured s, fitted s), for the log


def _label(batch: list[tuple[int, int, bool]]) -> str:
    prefills = [f"prefill {n}@{ctx}" for n, ctx, _ in batch if n > 1]
    decodes = [ctx for n, ctx, _ in batch if n == 1]
    if decodes:
        prefills.append(f"decode {len(decodes)} x ctx {decodes[0]}")
    return " + ".join(prefills)


def _predicted(s: StepSample, fitted: FittedStep, overhead_s: float, bw: float) -> float:
    return overhead_s + s.weight_bytes / bw + fitted.variable_s(s.features)


def _errors(
    samples: list[StepSample], fitted: FittedStep, overhead_s: float, bw: float
) -> list[float]:
    """Relative error of the fitted form on each timed step."""
    return [_predicted(s, fitted, overhead_s, bw) / s.measured_s - 1 for s in samples]


def calibrate(
    model_dir: str, dtype: str, name: str, transport: str, grid: Any, serving_requests: int = 30
) -> Calibration:
    from disagg.sim.measure_scheduler import measure_scheduler
    from disagg.sim.measure_serving import measure_serving
    from disagg.sim.measure_step import measure_memory_bandwidth, measure_steps
    from disagg.sim.measure_transport import measure_transport

    shape = _shape_in(model_dir, dtype)
    bandwidth = measure_memory_bandwidth()
    samples, mixed = measure_steps(model_dir, shape, dtype, grid)
    fitted, overhead_s = fit_step(samples, bandwidth)
    block_nbytes = 16 * shape.kv_bytes_per_token()
    labels = [_label(b) for b in grid.batches()] + [_label(b) for b in grid.mixed_batches()]
    steps = tuple(
        (label, s.measured_s, _predicted(s, fitted, overhead_s, bandwidth))
        for label, s in zip(labels, samples + mixed, strict=True)
    )
    return Calibration(
        name=name,
        date=time.strftime("%Y-%m-%d"),
        model=shape.name,
        dtype=dtype,
        fitted=fitted,
        step_overhead_s=overhead_s,
        memory_bandwidth=bandwidth,
        fit_errors=_errors(samples, fitted, overhead_s, bandwidth),
        mixed_errors=_errors(mixed, fitted, overhead_s, bandwidth),
        num_steps=len(samples),
        transport=measure_transport(transport, block_nbytes),
        serving=measure_serving(serving_requests),
        scheduler_s=measure_scheduler(),
        steps=steps,
    )


def _shape_in(model_dir: str, dtype: str) -> ModelShape:
    """The checkpoint's shape at the dtype it is timed in (KV and weights bytes follow it)."""
    shape = load_shape(model_dir)
    return replace(shape, dtype_bytes=4 if dtype == "float32" else 2)


def _worst(errors: list[float]) -> str:
    return f"{max((abs(e) for e in errors), default=0.0):.1%}"


def format_profile(c: Calibration) -> str:
    """The TOML text; each figure names what was timed, on which day."""
    t = c.transport
    on = f"measured by disagg sim calibrate on {c.date}"
    step = f"{on}, fitted to {c.num_steps} timed ModelRunner.execute steps of {c.model} ({c.dtype}, 1 thread)"  # noqa: E501
    fit = f"fit error: worst {_worst(c.fit_errors)}; held-out prefill+decode steps: worst {_worst(c.mixed_errors)}"  # noqa: E501
    xfer = f"{on}, {t.num_transfers} {t.kind} READs of {t.block_nbytes}-byte blocks in one process (least squares)"  # noqa: E501
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sched_fixed, sched_req = c.scheduler_s
    v = c.serving
    lines = [
        "# A measured CPU profile: one engine process, one torch thread. Steps use the fitted",
        "# sum form (disagg/sim/fitted_step.py), not the GPU roofline. Regenerate with",
        f"#   disagg sim --model CKPT calibrate --dtype {c.dtype} --name {c.name}",
        f'name = "{c.name}"',
        "",
        "[fitted_step]",
        f"# {step}; {fit}",
        f"# per_request_s adds Scheduler.schedule+update's {sched_req * 1e6:.2f} us per request",
        f"per_request_s = {c.fitted.per_request_s + sched_req:.6g}",
        f"matmul_flops_per_s = {c.fitted.matmul_flops_per_s:.6g}",
        f"attention_flops_per_s = {c.fitted.attention_flops_per_s:.6g}",
        f"kv_read_bytes_per_s = {c.fitted.kv_read_bytes_per_s:.6g}",
        "",
        "[engine]",
        f"# {step}: the fit's intercept, plus Scheduler.schedule+update's fixed",
        f"# {sched_fixed * 1e6:.1f} us per step ({on}, decode steps of 1-128 requests)",
        f"step_overhead_s = {c.step_overhead_s + sched_fixed:.6g}",
        f"# {on}: {v.num_requests} streamed requests, one at a time, through `disagg up`",
        "# (router + 1 instance, separate processes) on a 1-layer checkpoint: median ITL",
        f"# {v.itl_s * 1e3:.3f} ms minus that checkpoint's decode Engine.step in a fresh process",
        f"# {v.step_s * 1e3:.3f} ms = {(v.itl_s - v.step_s) * 1e3:.4g} ms, clamped at 0 (on a busy",
        "# machine tokens arrive coalesced and the median ITL can fall below the step); the sim",
        "# adds it to a step per sampled token",
        f"output_token_s = {v.output_token_s:.6g}",
        "",
        "[compute]",
        "# The roofline's fields, for tools that read them: the fitted matmul rate at 100%.",
        f"peak_flops = {c.fitted.matmul_flops_per_s:.6g}",
        "mfu = 1.0",
        "",
        "[memory]",
        f"# {on}, a 256 MiB tensor copy on one thread (bytes read + written / s)",
        f"memory_bandwidth = {c.memory_bandwidth:.6g}",
        "memory_efficiency = 1.0",
        "# This machine's physical memory (os.sysconf); the engine's pool is set by --num-blocks.",
        f"memory_bytes = {ram:.6g}",
        "memory_utilization = 0.9  # ASSUMPTION, as the GPU profiles",
        "reserved_bytes = 0.0",
        "",
        "[interconnect]",
        "# Unused: fitted profiles are single-process (tp=1); every profile carries it.",
        f"nvlink_bandwidth = {c.memory_bandwidth:.6g}",
        "nvlink_efficiency = 1.0",
        "",
        "[network]",
        f"# {xfer}: bytes / s",
        f"bandwidth_per_gpu = {t.bandwidth:.6g}",
        "gpus_per_node = 1",
        "efficiency = 1.0",
        "# The transfer's fixed cost is in kv_setup.fixed_s; completion is seen by the poll.",
        "latency_s = 0.0",
        f"# {on}: median share of a READ's time spent inside post() = {t.post_share:.2f}",
        f"copy_in_post = {'true' if t.is_copy_in_post else 'false'}",
        f"# {on}, the same requests: half of (TTFT - the instance's queue + prefill",
        f"# stages), median {v.ttft_outside_stages_s * 1e3:.3f} ms",
        f"http_hop_s = {v.hop_s:.6g}",
        "",
        "[kv_setup]",
        f"# {xfer}",
        f"fixed_s = {t.fixed_s:.6g}",
        f"per_descriptor_s = {t.per_descriptor_s:.6g}",
        "",
        *_host_lines(on, v),
    ]
    return "\n".join(lines) + "\n"


def _host_lines(on: str, v: Any) -> list[str]:
    """[host]: the cores a one-host deployment's processes share and the serving work around
    its engines (host_cpu.py), from the serving-path runs' CPU time (measure_serving.py)."""
    return [
        "[host]",
        "# The cores this machine's processes share (os.sched_getaffinity).",
        f"num_cores = {v.num_cores}",
        f"# {on}, the serving-path runs' CPU-seconds outside the engine-loop threads (router +",
        "# client + the instance's event loop), from /proc, solved over two runs of 33 and 2",
        "# output tokens: per streamed token, per request, and the instance loop's per request",
        f"token_cpu_s = {v.token_cpu_s:.6g}",
        f"request_cpu_s = {v.request_cpu_s:.6g}",
        f"loop_request_cpu_s = {v.loop_request_cpu_s:.6g}",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`disagg sim --model CKPT calibrate ...`: the checkpoint is the sim's --model."""
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--name", default="cpu-dev", help="profile name (and file stem)")
    parser.add_argument("--out", default=None, help="default: the sim's hardware directory")
    parser.add_argument("--transport", default="nixl", choices=["nixl", "tcp", "local"])
    parser.add_argument("--prefill-lens", default="64,256,1024,2048,4096")
    parser.add_argument("--prefill-contexts", default="1024")
    parser.add_argument("--decode-batches", default="1,4,16,32")
    parser.add_argument("--decode-contexts", default="128,1024,4095")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per step shape")
    parser.add_argument(
        "--serving-requests", type=int, default=30,
        help="streamed requests through a local router + instance to time the serving path",
    )  # fmt: skip


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def run(args: argparse.Namespace) -> int:
    from disagg.sim.measure_step import StepGrid

    grid = StepGrid(
        prefill_lens=_ints(args.prefill_lens),
        prefill_contexts=_ints(args.prefill_contexts),
        decode_batches=_ints(args.decode_batches),
        decode_contexts=_ints(args.decode_contexts),
        repeats=args.repeats,
    )
    started = time.perf_counter()
    result = calibrate(
        args.model, args.dtype, args.name, args.transport, grid, args.serving_requests
    )
    path = Path(args.out) if args.out else _PROFILE_DIR / f"{args.name}.toml"
    path.write_text(format_profile(result))
    load_profile(str(path))  # what was written must load
    print(format_profile(result))
    print("| step | measured ms | fitted ms | error |\n|---|---|---|---|")
    for label, measured_s, fitted_s in result.steps:
        error = fitted_s / measured_s - 1
        print(f"| {label} | {measured_s * 1e3:.2f} | {fitted_s * 1e3:.2f} | {error:+.1%} |")
    print(f"wrote {path} in {time.perf_counter() - started:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m disagg.sim.calibrate --model CKPT ...`: the same, without the sim's CLI (so
    it can time another checkout's engine put first on PYTHONPATH)."""
    parser = argparse.ArgumentParser(prog="disagg.sim.calibrate", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint directory to time")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
