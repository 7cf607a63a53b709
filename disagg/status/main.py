"""`disagg status`: every instance behind a router, refreshed like `top`, or once for scripts.

Owns the command line and the terminal (alternate screen, `q` quits); fetching is probe.py,
the records snapshot.py, the drawing screen.py. The endpoints it reads are open (no API key
or cluster token needed). Never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import sys
import termios
import time
import tty
import urllib.parse
from collections.abc import Callable, Iterator

from disagg.status.probe import take_snapshot
from disagg.status.records import ClusterStatus
from disagg.status.screen import render

__all__ = ["add_arguments", "run"]

DEFAULT_ROUTER = "http://127.0.0.1:8000"  # `disagg route` / `disagg up` default address
_ENTER_SCREEN = "\x1b[?1049h\x1b[?25l"  # alternate screen, cursor hidden: top's way
_LEAVE_SCREEN = "\x1b[?25h\x1b[?1049l"
_HOME_CLEAR = "\x1b[H\x1b[2J"
_QUIT_KEYS = ("q", "Q")

WaitForKey = Callable[[float], str | None]  # wait up to this many seconds; the key pressed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Show every instance behind a router: role, health, running and waiting requests, "
        "KV blocks in use, KV handoffs and failures, TTFT stage means and engine-loop time "
        "spent on KV work. Refreshes until you press q or Ctrl-C."
    )
    parser.add_argument(
        "--router", default=DEFAULT_ROUTER, metavar="URL",
        help="the router's base URL (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--interval", type=_positive, default=2.0, metavar="SECONDS",
        help="seconds between refreshes of the live view (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=_positive, default=2.0, metavar="SECONDS",
        help="how long to wait for each endpoint before showing it as down "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--once", action="store_true",
        help="print one snapshot and exit; the exit code is 1 if the router does not answer",
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true",
        help="print JSON instead of tables, one document per line per snapshot "
        "(instances, their counters and means; null where a probe failed)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        router_url = _base_url(args.router)
    except ValueError as exc:
        print(f"disagg status: {exc}", file=sys.stderr)
        return 2
    if args.once:
        status = take_snapshot(router_url, args.timeout)
        print(_as_text(status, args.json, interval_s=None))
        return 0 if status.router.is_reachable else 1
    is_screen = not args.json and sys.stdout.isatty()
    try:
        with _screen() if is_screen else contextlib.nullcontext(), _keys() as wait_for_key:
            _refresh_forever(router_url, args, is_screen, wait_for_key)
    except KeyboardInterrupt:
        pass
    return 0


def _refresh_forever(
    router_url: str, args: argparse.Namespace, is_screen: bool, wait_for_key: WaitForKey
) -> None:
    while True:
        started_s = time.monotonic()
        status = take_snapshot(router_url, args.timeout)
        if is_screen:
            size = shutil.get_terminal_size()
            text = render(
                status, interval_s=args.interval, width=size.columns, height=size.lines, color=True
            )
            sys.stdout.write(_HOME_CLEAR + text)
        else:
            sys.stdout.write(_as_text(status, args.json, interval_s=args.interval) + "\n")
            sys.stdout.write("" if args.json else "\n")  # a blank line between piped frames
        sys.stdout.flush()
        left_s = args.interval - (time.monotonic() - started_s)
        if wait_for_key(max(left_s, 0.0)) in _QUIT_KEYS:
            return


def _as_text(status: ClusterStatus, as_json: bool, *, interval_s: float | None) -> str:
    if as_json:
        return json.dumps(status.to_dict())
    return render(status, interval_s=interval_s)


@contextlib.contextmanager
def _screen() -> Iterator[None]:
    sys.stdout.write(_ENTER_SCREEN)
    try:
        yield
    finally:
        sys.stdout.write(_LEAVE_SCREEN)
        sys.stdout.flush()


@contextlib.contextmanager
def _keys() -> Iterator[WaitForKey]:
    """A `wait(seconds) -> key | None`; keys are read one at a time (no Enter) when stdin is a
    terminal, otherwise `wait` only sleeps."""
    if not sys.stdin.isatty():
        yield _sleep
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield lambda seconds: _read_key(fd, seconds)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _sleep(timeout_s: float) -> None:
    time.sleep(timeout_s)


def _read_key(fd: int, timeout_s: float) -> str | None:
    readable, _, _ = select.select([fd], [], [], timeout_s)
    return os.read(fd, 1).decode(errors="replace") if readable else None


def _base_url(text: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`."""
    url = text.strip().rstrip("/")
    url = url if "://" in url else f"http://{url}"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path:
        raise ValueError(f"--router must look like http://host:port, got {text!r}")
    return url


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value
