"""`disagg <command>`: one entry point; each command lives in the module that owns it.

Modules are imported lazily so that `disagg route` and `disagg bench` never import torch.
Each command module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("disagg.server.main", "run one engine instance (role both, prefill or decode)"),
    "route": ("disagg.router.main", "run the OpenAI-compatible router in front of instances"),
    "up": ("disagg.launcher", "start a local cluster (router + instances) and wait"),
    "status": ("disagg.status.main", "live view of every instance behind a router (like top)"),
    "bench": ("disagg.bench.main", "load-test any OpenAI-compatible server"),
    "sim": ("disagg.sim.main", "simulate a deployment (pull, push, aggregated) on a cost model"),
    "make-model": ("disagg.engine.make_model", "write a random-weight checkpoint"),
    "convert": ("disagg.engine.checkpoint", "resolve a short model name to a local directory"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("disagg")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="disagg",
        description="LLM serving with prefill and decode on separate instances: run "
        "instances and a router, watch them, benchmark them, simulate them on GPUs.",
        epilog="`disagg COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if argv[:1] == ["--version"]:
        print(f"disagg {_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help or the error, then exits
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd_parser = argparse.ArgumentParser(prog=f"disagg {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
