"""`disagg up`: the command line. Reads the flags and the --config file into a ClusterConfig,
runs the cluster on the backend it names (local children, or Ray actors), reports readiness,
and stops it on SIGINT/SIGTERM or when a process dies. The cluster itself is launcher.py's
(or ray_backend.py's); Ray is imported only for its backend.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from types import FrameType

from disagg.cluster.config import add_arguments, config_from_args
from disagg.cluster.launcher import Cluster
from disagg.cluster.processes import HEALTH_POLL_S, url_of

__all__ = ["add_arguments", "run"]


class _StopSignals:
    """Records SIGINT/SIGTERM instead of raising, so a stop never interrupts a half-done step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in self._previous:
            signal.signal(sig, self._record)

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def is_requested(self) -> bool:
        return self.signal_name is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _say(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        print(f"disagg up: {exc}", file=sys.stderr)
        return 2
    stop = _StopSignals()
    if config.backend == "ray":
        from disagg.cluster import ray_backend  # Ray is optional: imported only for this backend

        try:
            return ray_backend.run(config, stop.is_requested, _say)
        finally:
            stop.restore()
    cluster = Cluster(config, echo=_say)
    try:
        return _run_cluster(cluster, stop)
    finally:
        cluster.stop()
        stop.restore()


def _run_cluster(cluster: Cluster, stop: _StopSignals) -> int:
    try:
        cluster.start(should_stop=stop.is_requested)
    except RuntimeError as exc:
        if stop.is_requested():
            _say(f"disagg up: {stop.signal_name} during startup, stopped")
            return 0
        print(f"disagg up: {exc}", file=sys.stderr)
        return 1
    _announce(cluster)
    while not stop.is_requested():
        dead = cluster.dead_process()
        if dead is not None:
            time.sleep(HEALTH_POLL_S)  # a Ctrl-C reaches the children too: was it ours?
            if stop.is_requested():
                break
            print(f"disagg up: {dead}\nstopping the cluster", file=sys.stderr)
            return 1
        time.sleep(HEALTH_POLL_S)
    _say(f"disagg up: {stop.signal_name}, stopping the router, then the instances")
    return 0


def _announce(cluster: Cluster) -> None:
    cfg = cluster.config
    num_decode = sum(len(urls) for role, urls in cluster.instance_urls.items() if role != "prefill")
    num_prefill = len(cluster.instance_urls.get("prefill", []))
    ready = f"disagg up ready on {url_of(cfg.host, cluster.port)}"
    if cfg.mode == "aggregated":
        _say(f"{ready} (mode aggregated: {num_decode} instance(s), prefill and decode in each)")
    else:
        _say(f"{ready} (mode {cfg.mode}: {num_prefill} prefill, {num_decode} decode)")
    body = json.dumps({"model": cfg.model, "prompt": "Hello", "max_tokens": 16})
    _say(
        f"  try: curl -s {cluster.url}/v1/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}"
    )
