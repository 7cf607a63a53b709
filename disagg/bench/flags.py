"""The workload and arrival flags `disagg bench` and `disagg sim` share (same names, same
defaults), the WorkloadConfig they parse into, and `from_flags`, which fills any config
dataclass from the flags named as its fields. No aiohttp or torch here: the simulator imports
it without the load generator's client."""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from typing import Any, TypeVar

from disagg.bench.workload import DATASETS, WorkloadConfig

__all__ = [
    "add_arrival_arguments", "add_workload_arguments", "from_flags", "workload_from_args",
    "workload_keys",
]  # fmt: skip

_Config = TypeVar("_Config")


def add_workload_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset", choices=list(DATASETS), default="random",
        help="random token ids; text = English prose; prefix = shared prefixes + random "
        "suffixes; multiturn = conversations (a shared system prompt of --prefix-len tokens, "
        "--num-turns user turns of --input-len, each answer kept in the history)",
    )  # fmt: skip
    g.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send (multiturn: conversations)")  # fmt: skip
    g.add_argument("--num-turns", type=int, default=1, help="turns per conversation (multiturn)")
    g.add_argument(
        "--random-input-len",
        "--input-len",
        dest="input_len",
        type=int,
        default=128,
        help="prompt tokens (prefix dataset: tokens after the shared prefix)",
    )
    g.add_argument(
        "--random-output-len", "--output-len", dest="output_len", type=int, default=32,
        help="output tokens per request (generation ignores EOS)",
    )  # fmt: skip
    g.add_argument(
        "--random-range-ratio",
        "--range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)], r in [0, 1)",
    )
    g.add_argument("--prefix-len", type=int, default=64, help="shared prefix tokens (prefix)")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    g.add_argument(
        "--token-range",
        default="100:1900",
        help="random token ids drawn from [LO, HI): keep clear of special tokens",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
    return g


def add_arrival_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = all at once")
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps; 1 = Poisson, <1 burstier",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    return g


def from_flags(config_type: type[_Config], args: argparse.Namespace, **values: Any) -> _Config:
    """A config_type (a dataclass) from the parsed flags whose dest is one of its fields, as
    given; `values` set the fields whose flag is spelled or typed otherwise."""
    names = [f.name for f in fields(config_type)]  # type: ignore[arg-type]
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return config_type(**{**given, **values})


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    """The WorkloadConfig of parsed workload flags (raises ValueError on bad values)."""
    return from_flags(WorkloadConfig, args, token_range=_parse_token_range(args.token_range))


def workload_keys(w: WorkloadConfig) -> dict[str, object]:
    """The workload's keys in a result file (vLLM's benchmark names), for bench and sim alike."""
    return {
        "dataset": w.dataset,
        "num_prompts": w.num_prompts,
        "random_input_len": w.input_len,
        "random_output_len": w.output_len,
        "random_range_ratio": w.range_ratio,
        "prefix_len": w.prefix_len if w.dataset in ("prefix", "multiturn") else 0,
        **({"num_turns": w.num_turns} if w.dataset == "multiturn" else {}),
        "seed": w.seed,
    }


def _parse_token_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep:
        raise ValueError(f"--token-range must be LO:HI, got {text!r}")
    return int(lo), int(hi)
