"""A fake `disagg up` for the sweep tests: serves /health and the fake OpenAI API on --port.

Records its argv (and the pid of an optional child) as JSON to --record, so tests can check
the command line the sweep built and that stopping reaches the children. Flags make it slow to
become healthy, never healthy, or deaf to SIGTERM. Run as a script: `python fake_up.py ...`.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.`
from tests.bench.fake_server import FakeBehavior, make_app  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--health-delay", type=float, default=0.0)
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--spawn-child", action="store_true")
    args, _ = parser.parse_known_args()  # --mode, --model, ... are only recorded
    child = None
    if args.spawn_child:  # stands in for an engine instance the launcher would start
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    record = {"argv": sys.argv[1:], "child_pid": child.pid if child else None}
    Path(args.record).write_text(json.dumps(record))
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.never_healthy:
        time.sleep(120)  # the test must give up on /health and kill us
        return
    time.sleep(args.health_delay)
    web.run_app(
        make_app(FakeBehavior()),
        host="127.0.0.1",
        port=args.port,
        print=None,
        handle_signals=not args.ignore_sigterm,
    )
    if child is not None:  # a well-behaved launcher stops its children on SIGTERM
        child.terminate()
        child.wait(timeout=10)


if __name__ == "__main__":
    main()
