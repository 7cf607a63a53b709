"""`disagg <command>`: one entry point; each command lives in the module that owns it.

Modules are imported lazily so that `disagg route` and `disagg bench` never import torch.
Each command module exposes `add_arguments(parser)` and `run(args) -> int`.

Errors a user causes (a bad model directory, a missing tokenizer, an unsupported architecture,
a port in use, a missing transport library) end the command with one line naming the thing,
exit code 2 for bad input and 1 for the environment; `--debug` (anywhere on the line) or
DISAGG_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import select
import signal
import sys

__all__ = ["main"]

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("disagg.server.main", "run one engine instance (role both, prefill or decode)"),
    "route": ("disagg.router.main", "run the OpenAI-compatible router in front of instances"),
    "up": ("disagg.cluster.up", "start a local cluster (router + instances) and wait"),
    "status": ("disagg.status.main", "live view of every instance behind a router (like top)"),
    "scale": (
        "disagg.cluster.scale",
        "grow or drain one role of a cluster on Ray, dropping nothing",
    ),
    "bench": ("disagg.bench.main", "load-test any OpenAI-compatible server"),
    "sim": ("disagg.sim.main", "simulate a deployment (pull, push, aggregated) on a cost model"),
    "make-model": ("disagg.engine.make_model", "write a random-weight checkpoint"),
    "convert": ("disagg.engine.checkpoint", "resolve a short model name to a local directory"),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except empty ones and where the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default in (None, "", [], False, True):
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("disagg")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("DISAGG_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    parser = argparse.ArgumentParser(
        prog="disagg",
        description="LLM serving with prefill and decode on separate instances: run "
        "instances and a router, watch them, benchmark them, simulate them on GPUs.",
        epilog="`disagg COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
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
    cmd_parser = argparse.ArgumentParser(
        prog=f"disagg {argv[0]}",
        description=COMMANDS[argv[0]][1],
        formatter_class=_HelpFormatter,
    )
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and _is_stdout_reader_gone():
            return _quit_quietly()
        if debug or not _is_user_error(exc):
            raise
        print(f"disagg {argv[0]}: error: {_one_line(exc)}", file=sys.stderr)
        return 1 if isinstance(exc, OSError) and not _is_missing_file(exc) else 2


def _is_stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reader closed it (`| head`), as opposed to a broken
    pipe to some peer's socket, which is a real error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (OSError, ValueError):  # stdout is closed or not a file (captured in-process)
        return False
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _quit_quietly() -> int:
    """Point stdout at /dev/null, so that the interpreter's own flush at exit does not report
    the broken pipe again, and exit as a process killed by SIGPIPE would (`yes | head`)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _is_user_error(exc: Exception) -> bool:
    from disagg.kv.transport.base import TransportError  # no torch, no NIXL

    return isinstance(exc, ValueError | OSError | TransportError)


def _is_missing_file(exc: OSError) -> bool:
    return exc.errno == errno.ENOENT or isinstance(exc, FileNotFoundError)


def _one_line(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"{exc.strerror or exc}: another process listens there; choose another --port"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text + " (--debug shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())
