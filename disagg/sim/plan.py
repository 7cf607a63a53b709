"""`disagg sim plan`: the cheapest deployments that meet TTFT and TPOT SLOs at a request rate.

Searches mode x prefill count x decode count (aggregated: instance count) x tensor parallelism
(`--tps`; every instance of a deployment at the same TP, since our KV handoff moves each rank's
shard to the same rank) in order of GPUs, simulates each under the same seeded workload, and
stops after the smallest GPU count at which some deployment meets the SLOs. A deployment meets
them when at least `--attainment` of its requests meet both (the bench's goodput definition).
A TP at which the model's weights do not fit one instance's GPUs is skipped.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from disagg.sim.cluster import run_simulation
from disagg.sim.cost import CostModel
from disagg.sim.hardware import load_profile
from disagg.sim.model_shape import load_shape
from disagg.sim.sim_config import SimConfig

__all__ = [
    "PlanRow",
    "add_arguments",
    "by_gpu_count",
    "candidates",
    "format_rows",
    "format_verdict",
    "plan",
    "run",
]


@dataclass(frozen=True, slots=True)
class PlanRow:
    config: SimConfig
    attainment: float  # fraction of requests meeting both SLOs
    p90_ttft_ms: float
    median_tpot_ms: float

    @property
    def num_gpus(self) -> int:
        return self.config.num_gpus


def candidates(base: SimConfig, modes: list[str], num_instances: int) -> list[SimConfig]:
    """Every deployment of `num_instances` instances in `modes`."""
    out = []
    for mode in modes:
        if mode == "aggregated":
            out.append(replace(base, mode="aggregated", num_prefill=num_instances, num_decode=0))
            continue
        for num_prefill in range(1, num_instances):
            out.append(
                replace(
                    base,
                    mode=mode,  # type: ignore[arg-type]
                    num_prefill=num_prefill,
                    num_decode=num_instances - num_prefill,
                )
            )
    return out


def _evaluate(config: SimConfig) -> PlanRow:
    result, _ = run_simulation(config)
    good = result["request_goodput"] or 0.0
    attainment = good / result["request_throughput"] if result["request_throughput"] else 0.0
    return PlanRow(config, attainment, result["p90_ttft_ms"], result["median_tpot_ms"])


def _fits(config: SimConfig) -> bool:
    try:
        shape, profile = load_shape(config.model), load_profile(config.hardware)
        CostModel(shape, profile, config.tp).num_blocks(config.block_size)
    except ValueError:  # the weights alone overflow the instance's memory
        return False
    return True


def by_gpu_count(
    base: SimConfig, modes: list[str], tps: list[int], max_gpus: int
) -> list[tuple[int, list[SimConfig]]]:
    """Every deployment within `max_gpus`, grouped by GPU count, fewest first."""
    groups: dict[int, list[SimConfig]] = {}
    for tp in sorted(set(tps)):
        sized = replace(base, tp=tp)
        if not _fits(sized):
            continue
        for num_instances in range(1, max_gpus // tp + 1):
            groups.setdefault(num_instances * tp, []).extend(
                candidates(sized, modes, num_instances)
            )
    return sorted(groups.items())


def plan(
    base: SimConfig,
    modes: list[str],
    max_gpus: int,
    attainment: float,
    tps: list[int] | None = None,
) -> list[PlanRow]:
    """Rows of every deployment tried, up to the first GPU count where one meets the SLOs."""
    rows: list[PlanRow] = []
    for _, configs in by_gpu_count(base, modes, tps or [base.tp], max_gpus):
        tried = [_evaluate(c) for c in configs]
        rows.extend(tried)
        if any(row.attainment >= attainment for row in tried):
            break
    return rows


def _ranked(rows: list[PlanRow], attainment: float) -> list[PlanRow]:
    """Deployments meeting the SLOs first, then fewest GPUs, then most requests within SLO."""
    return sorted(rows, key=lambda r: (r.attainment < attainment, r.num_gpus, -r.attainment))


def format_rows(rows: list[PlanRow], attainment: float) -> str:
    lines = [
        "| mode | prefill | decode | TP | GPUs | SLO met by | p90 TTFT ms | median TPOT ms | ok |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in _ranked(rows, attainment):
        c = r.config
        decode = c.num_decode if c.mode != "aggregated" else "-"
        ok = "yes" if r.attainment >= attainment else "no"
        lines.append(
            f"| {c.mode} | {c.num_prefill} | {decode} | {c.tp} | {r.num_gpus} | {r.attainment:.0%} "
            f"| {r.p90_ttft_ms:.0f} | {r.median_tpot_ms:.1f} | {ok} |"
        )
    return "\n".join(lines)


def _deployment(config: SimConfig) -> str:
    """`push, 1 prefill + 2 decode at TP 1`, `aggregated, 3 instances at TP 1`."""
    if config.mode == "aggregated":
        counts = f"{config.num_prefill} instance{'s' if config.num_prefill != 1 else ''}"
    else:
        counts = f"{config.num_prefill} prefill + {config.num_decode} decode"
    return f"{config.mode}, {counts} at TP {config.tp}"


def format_verdict(rows: list[PlanRow], attainment: float, max_gpus: int) -> str:
    """One line naming the cheapest deployment that meets the SLOs, or saying none does (and
    which came closest: most requests within SLO, then fewest GPUs)."""
    best = _ranked(rows, attainment)[0]
    if best.attainment < attainment:
        best = min(rows, key=lambda r: (-r.attainment, r.num_gpus))
    gpus = f"{best.num_gpus} GPU{'s' if best.num_gpus != 1 else ''}"
    found = f"{_deployment(best.config)} ({gpus}, {best.attainment:.0%} of requests within SLO)"
    if best.attainment >= attainment:
        return f"cheapest meeting the SLO: {found}"
    return (
        f"no deployment meets the SLO within {max_gpus} GPUs (it needs {attainment:.0%} of "
        f"requests within SLO); closest: {found}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slo-ttft-ms", type=float, required=True, metavar="MS",
        help="time to first token SLO, ms: a request meets it when its first token arrives "
        "within this many ms of being sent (required)",
    )  # fmt: skip
    parser.add_argument(
        "--slo-tpot-ms", type=float, required=True, metavar="MS",
        help="time per output token SLO, ms: a request meets it when its tokens after the "
        "first arrive at most this many ms apart on average (required)",
    )  # fmt: skip
    parser.add_argument(
        "--max-gpus", type=int, default=8, metavar="N",
        help="most GPUs a deployment may use (instances x TP); GPU counts are tried from the "
        "fewest up, stopping at the first where a deployment meets the SLOs "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--modes", default="pull,push,aggregated", metavar="MODES",
        help="deployment modes to search, comma-separated, from pull, pull-inline, push and "
        "aggregated; each disaggregated mode is tried at every prefill:decode split "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--tps",
        default=None,
        help="tensor-parallel sizes to search, comma-separated (default: the --tp given)",
    )
    parser.add_argument(
        "--attainment", type=float, default=0.9,
        help="fraction of requests that must meet both SLOs for a deployment to meet them "
        "(default: %(default)s)",
    )  # fmt: skip


def run(args: argparse.Namespace, base: SimConfig) -> int:
    slos = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    base = replace(base, goodput_slos_ms=slos)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tps = _int_list(args.tps) if args.tps else [base.tp]
    rows = plan(base, modes, args.max_gpus, args.attainment, tps)
    if not rows:
        raise SystemExit(f"error: {base.model} fits no TP in {tps} within {args.max_gpus} GPUs")
    print(format_rows(rows, args.attainment))
    print(format_verdict(rows, args.attainment, args.max_gpus))
    return 0 if any(r.attainment >= args.attainment for r in rows) else 1


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: --tps takes comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"error: --tps takes positive integers, got {text!r}")
    return values


def summary(rows: list[PlanRow]) -> list[dict[str, Any]]:
    return [
        {
            "mode": r.config.mode,
            "num_prefill": r.config.num_prefill,
            "num_decode": r.config.num_decode,
            "tp": r.config.tp,
            "num_gpus": r.num_gpus,
            "attainment": r.attainment,
        }
        for r in rows
    ]
