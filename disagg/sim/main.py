"""`disagg sim`: simulate a deployment under a `disagg bench` workload, write bench-keyed JSON.

Takes the bench's workload and load flags (same names and defaults) plus the deployment:
`--mode --num-prefill --num-decode --model --hardware --tp`. Prints the bench's table, then
one JSON summary as the last stdout line. Subcommands: plan, sweep, validate, calibrate. Only
calibrate (which measures this machine) imports torch and aiohttp, and only when it runs.
"""

from __future__ import annotations

import argparse
import sys

from disagg.bench import report
from disagg.bench.flags import add_arrival_arguments, add_workload_arguments, workload_from_args
from disagg.bench.metrics import parse_goodput, parse_percentiles
from disagg.sim import calibrate, plan, sweep, validate
from disagg.sim.cluster import run_simulation
from disagg.sim.hardware import list_profiles
from disagg.sim.model_shape import BUILTIN_SHAPES
from disagg.sim.sim_config import SimConfig

__all__ = ["add_arguments", "config_from_args", "run"]


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload and load flags of `disagg bench` (shared definitions), and its outputs."""
    add_workload_arguments(parser)
    g = add_arrival_arguments(parser)
    g.add_argument("--percentiles", default="90,99", help="latency percentiles to report")
    g.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:1000 tpot:20",
    )  # fmt: skip
    g.add_argument("--result-file", default=None, help="write the full JSON result here")


def _add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("simulated deployment")
    g.add_argument(
        "--mode",
        choices=["pull", "pull-inline", "push", "aggregated"],
        default="pull",
        help="pull: READ set up off D's loop (ours); pull-inline: on it (vLLM's pull)",
    )
    g.add_argument("--num-prefill", type=int, default=1, help="prefill instances")
    g.add_argument("--num-decode", type=int, default=1, help="decode instances")
    g.add_argument(
        "--model", default="Qwen3-32B", help=f"{', '.join(BUILTIN_SHAPES)} or a config.json"
    )
    g.add_argument("--hardware", default="h200-p5en", help=f"{list_profiles()} or a TOML path")
    g.add_argument("--tp", type=int, default=1, help="GPUs per instance")
    g.add_argument(
        "--layout",
        choices=["vllm", "ours"],
        default="vllm",
        help="transfer descriptors: vllm (layer x K/V x block) or ours (per block, merged)",
    )
    g.add_argument(
        "--policy", choices=["least_loaded", "round_robin", "kv_aware"], default="least_loaded",
        help="the router's choice of instance (kv_aware: by cached prefix and load, as "
        "`disagg route --policy kv_aware`)",
    )  # fmt: skip
    g.add_argument(
        "--kv-aware-request-tokens", type=int, default=16,
        help="kv_aware: what one request already on an instance weighs, in prompt tokens",
    )  # fmt: skip
    g.add_argument(
        "--local-prefill-tokens", type=int, default=0,
        help="P/D under kv_aware: prefill a request on the decode instance when it lacks at "
        "most this many of its prompt tokens; 0 = never",
    )  # fmt: skip
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-blocks", type=int, default=None, help="default: what memory holds")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="tokens per engine step"
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests running per instance"
    )
    g.add_argument(
        "--max-model-len", type=int, default=None,
        help="longest request (default: the workload's longest)",
    )  # fmt: skip
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagg sim`; `disagg sim [flags] plan ...` searches deployments (the workload
    and deployment flags before `plan` set the traffic, model, hardware and tp)."""
    _add_workload_arguments(parser)
    _add_deployment_arguments(parser)
    sub = parser.add_subparsers(dest="sim_command", metavar="{plan,sweep,validate,calibrate}")
    plan.add_arguments(sub.add_parser("plan", help="cheapest deployments meeting the SLOs"))
    sweep.add_arguments(sub.add_parser("sweep", help="mode x input length x rate, to JSON"))
    validate.add_arguments(
        sub.add_parser("validate", help="predict a measured bench sweep, compare medians")
    )
    calibrate.add_arguments(
        sub.add_parser("calibrate", help="measure this machine (--model is the checkpoint)")
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    workload = workload_from_args(args)
    return SimConfig(
        mode=args.mode,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        model=args.model,
        hardware=args.hardware,
        tp=args.tp,
        layout=args.layout,
        policy=args.policy,
        kv_aware_request_tokens=args.kv_aware_request_tokens,
        local_prefill_tokens=args.local_prefill_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        workload=workload,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        percentiles=parse_percentiles(args.percentiles),
        goodput_slos_ms=parse_goodput(args.goodput),
    )


_SUBCOMMANDS = {"plan": plan.run, "sweep": sweep.run, "validate": validate.run}


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every request completed, 1 if some failed, 2 on bad flags."""
    try:
        command = getattr(args, "sim_command", None)
        if command == "calibrate":
            return calibrate.run(args)
        cfg = config_from_args(args)
        if command in _SUBCOMMANDS:
            return _SUBCOMMANDS[command](args, cfg)
        result, _ = run_simulation(cfg)
    except ValueError as exc:
        print(f"disagg sim: {exc}", file=sys.stderr)
        return 2
    print(report.format_table(result, cfg.percentiles))
    sim, num_requests = result["sim"], result["completed"] + result["failed"]
    print(
        f"simulated {num_requests} requests in {sim['wall_s']:.2f} s wall "
        f"({sim['requests_per_wall_s']:.0f} requests/s)"
    )
    if args.result_file:
        report.write_json(result, args.result_file)
    print(report.to_json_line(result))
    return 0 if result["failed"] == 0 else 1
