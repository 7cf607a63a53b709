"""`disagg bench sweep`: mode x request rate x prompt length, one local cluster per mode.

Owns the cluster's life as a subprocess (start the `disagg up` command, wait for GET /health,
stop with SIGTERM then SIGKILL), the grid loop over the in-process `run_benchmark`, and writing
sweep.json, sweep.md and the plots. Knows a cluster only by its command line and /health.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from disagg.bench import report
from disagg.bench.metrics import parse_goodput
from disagg.bench.runner import BenchConfig, run_benchmark
from disagg.bench.workload import WorkloadConfig
from disagg.cluster.processes import StartStop, free_port, wait_healthy

__all__ = [
    "MODES",
    "Cluster",
    "SweepConfig",
    "add_arguments",
    "cluster_command",
    "render_outputs",
    "run",
    "run_sweep",
    "write_outputs",
]

MODES = ("aggregated", "pull", "pull-inline", "push")  # pull = pull with background setup


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    model: str  # model directory passed to the up command
    modes: tuple[str, ...] = MODES
    request_rates: tuple[float, ...] = (0.5, 1.0, 2.0)  # req/s
    input_lens: tuple[int, ...] = (128, 512)  # prompt tokens
    output_len: int = 32  # tokens, the same for every run
    num_prompts: int = 20  # measured requests per run
    warmup: int = 2  # unmeasured requests once per cluster, before its first run
    num_prefill: int = 1  # instances per role in pull/push modes
    num_decode: int = 1
    up_command: tuple[str, ...] = ()  # () = this interpreter running `disagg up`
    up_args: tuple[str, ...] = ()  # passed through to the up command
    port: int = 0  # router port; 0 = a free one per cluster
    health_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    output_dir: Path = Path("docs/results")
    log_dir: Path | None = None  # None = output_dir / "logs"
    seed: int = 0
    burstiness: float = 1.0
    token_range: tuple[int, int] = (100, 1900)
    goodput_slos_ms: tuple[tuple[str, float], ...] = ()
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be a non-empty subset of {list(MODES)}, got {self.modes}")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError(f"request_rates must be > 0, got {self.request_rates}")
        if not self.input_lens or any(n <= 0 for n in self.input_lens):
            raise ValueError(f"input_lens must be > 0, got {self.input_lens}")
        for name in ("output_len", "num_prompts", "num_prefill", "num_decode"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def cluster_command(cfg: SweepConfig, mode: str, port: int) -> list[str]:
    """`disagg up --mode MODE --model DIR --port P --num-prefill N --num-decode M [extra]`.

    The aggregated baseline gets as many instances as the disaggregated modes have in all
    (N + M, round robin), so every mode runs on the same number of processes and cores."""
    base = list(cfg.up_command) or [sys.executable, "-m", "disagg.cli", "up"]
    cmd = base + ["--mode", mode.removesuffix("-inline"), "--model", cfg.model, "--port", str(port)]
    if mode == "pull-inline":
        cmd += ["--pull-setup", "inline"]
    if mode == "aggregated":
        cmd += ["--num-decode", str(cfg.num_prefill + cfg.num_decode)]
    else:
        cmd += ["--num-prefill", str(cfg.num_prefill), "--num-decode", str(cfg.num_decode)]
    return cmd + list(cfg.up_args)


class Cluster(StartStop):
    """One up-command subprocess in its own session, so a SIGKILL reaches its children too."""

    def __init__(
        self, command: list[str], port: int, log_path: Path, stop_timeout_s: float = 30.0
    ) -> None:
        self.command = command
        self.port = port
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s  # SIGTERM grace before SIGKILL
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _log_tail(self, num_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until GET /health is 200; RuntimeError if the process exits or time runs out."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        if not wait_healthy(f"{self.base_url}/health", deadline, self._check_running):
            raise RuntimeError(f"cluster not healthy after {timeout_s:.0f} s:\n{self._log_tail()}")

    def _check_running(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"cluster exited with code {self.proc.returncode} before /health was ready:\n"
                f"{self._log_tail()}"
            )

    def stop(self) -> int | None:
        """SIGTERM, wait up to `stop_timeout_s`, then SIGKILL the whole process group.

        Returns the up command's exit code (negative: killed by that signal); None if never started.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        return self.proc.wait(timeout=self.stop_timeout_s)

    def _kill_group(self) -> None:
        """SIGKILL whatever is left in the session: a stuck leader or children it leaked."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone


def _bench_config(
    cfg: SweepConfig, base_url: str, rate: float, input_len: int, warmup: int, run_index: int
) -> BenchConfig:
    # Fresh prompts for every grid point (a repeated prompt would be a prefix-cache hit on
    # the prefill side), but the same prompts for the same point in every mode.
    workload = WorkloadConfig(
        dataset="random",
        num_prompts=cfg.num_prompts,
        input_len=input_len,
        output_len=cfg.output_len,
        token_range=cfg.token_range,
        seed=cfg.seed + 7919 * run_index,
    )
    return BenchConfig(
        base_url=base_url,
        workload=workload,
        request_rate=rate,
        burstiness=cfg.burstiness,
        warmup=warmup,
        goodput_slos_ms=dict(cfg.goodput_slos_ms),
        request_timeout_s=cfg.request_timeout_s,
    )


def _run_grid(cfg: SweepConfig, mode: str, base_url: str) -> list[dict[str, Any]]:
    runs = []
    warmup = cfg.warmup  # once per cluster: the first run pays for it
    grid = [(n, r) for n in cfg.input_lens for r in cfg.request_rates]
    for run_index, (input_len, rate) in enumerate(grid):
        bench_cfg = _bench_config(cfg, base_url, rate, input_len, warmup, run_index)
        result = asyncio.run(run_benchmark(bench_cfg))
        warmup = 0
        runs.append(
            {
                "mode": mode,
                "request_rate": rate if math.isfinite(rate) else "inf",
                "input_len": input_len,
                "output_len": cfg.output_len,
                **{k: v for k, v in result.items() if k != "request_rate"},
            }
        )
        print(
            f"[sweep] {mode} rate={rate:g} input={input_len}: "
            f"{result['completed']}/{cfg.num_prompts} ok, "
            f"median TTFT {result['median_ttft_ms']:.1f} ms, "
            f"median TPOT {result['median_tpot_ms']:.1f} ms",
            file=sys.stderr,
        )
    return runs


def run_sweep(cfg: SweepConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """Every mode's grid; outputs rewritten after each mode. Returns (runs, failed modes)."""
    runs: list[dict[str, Any]] = []
    failed: list[str] = []
    log_dir = cfg.log_dir or cfg.output_dir / "logs"
    for mode in cfg.modes:
        port = cfg.port or free_port()
        log_path = log_dir / f"up-{mode}.log"
        cluster = Cluster(cluster_command(cfg, mode, port), port, log_path, cfg.stop_timeout_s)
        try:
            with cluster:
                cluster.wait_healthy(cfg.health_timeout_s)
                runs += _run_grid(cfg, mode, cluster.base_url)
        except (RuntimeError, OSError, ValueError, aiohttp.ClientError) as exc:
            print(f"[sweep] mode {mode} failed: {exc}", file=sys.stderr)
            failed.append(mode)
        if runs:
            write_outputs(runs, cfg.output_dir)
    return runs, failed


def render_outputs(runs: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """sweep.md and the PNG plots in `out_dir` (what --plot-only redoes); the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "sweep.md"
    md.write_text(report.format_sweep_markdown(runs))
    return [md, *report.plot_sweep(runs, out)]


def write_outputs(runs: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """sweep.json, sweep.md and the PNG plots in `out_dir`; returns the paths written."""
    return [report.write_json(runs, Path(out_dir) / "sweep.json"), *render_outputs(runs, out_dir)]


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagg bench sweep`."""
    parser.add_argument("--model", default=None, help="model directory for the up command")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--request-rates", default="0.5,1,2", help="req/s, comma-separated")
    parser.add_argument("--input-lens", default="128,512", help="prompt tokens, comma-separated")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=20, help="measured requests per run")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests per cluster")
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--up-command", default=None, help="default: this python -m disagg.cli up")
    parser.add_argument("--up-args", default="", help="extra arguments for the up command")
    parser.add_argument("--port", type=int, default=0, help="router port; 0 = a free one")
    parser.add_argument("--health-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="SIGTERM grace, seconds")
    parser.add_argument("--output-dir", default="docs/results")
    parser.add_argument("--log-dir", default=None, help="up command logs; default OUTPUT_DIR/logs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--token-range", default="100:1900", help="random token ids [LO, HI)")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="re-render sweep.md and plots from OUTPUT_DIR/sweep.json",
    )


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    if not args.model:
        raise ValueError("--model is required (a model directory for the up command)")
    lo, _, hi = args.token_range.partition(":")
    return SweepConfig(
        model=args.model,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        request_rates=_floats(args.request_rates),
        input_lens=_ints(args.input_lens),
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        warmup=args.warmup,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        up_command=tuple(shlex.split(args.up_command)) if args.up_command else (),
        up_args=tuple(shlex.split(args.up_args)),
        port=args.port,
        health_timeout_s=args.health_timeout,
        stop_timeout_s=args.stop_timeout,
        output_dir=Path(args.output_dir),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        seed=args.seed,
        burstiness=args.burstiness,
        token_range=(int(lo), int(hi)),
        goodput_slos_ms=tuple(parse_goodput(args.goodput).items()),
        request_timeout_s=args.request_timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every mode ran, 1 when some failed, 2 on bad flags or a missing sweep.json."""
    if args.plot_only:
        path = Path(args.output_dir) / "sweep.json"
        if not path.is_file():
            print(f"disagg bench sweep: no {path}", file=sys.stderr)
            return 2
        for written in render_outputs(json.loads(path.read_text()), args.output_dir):
            print(written)
        return 0
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"disagg bench sweep: {exc}", file=sys.stderr)
        return 2
    runs, failed = run_sweep(cfg)
    print(report.format_sweep_markdown(runs) if runs else "no runs completed")
    return 1 if failed or not runs else 0
