"""`disagg up`: start a local cluster (instances, then the router), wait until healthy, tear down.

Owns the cluster's plan and order: which children, on which ports, healthy in time, stopped
router first; processes.py is the per-process plumbing (ports, logs, health probes,
children that die with the launcher). Serving and routing live in the children; torch is
imported here only when a short model name must be converted, once, before the instances start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType

from disagg.cluster.config import ClusterConfig, add_arguments, config_from_args
from disagg.cluster.processes import (
    Child,
    check_port_free,
    die_with_parent_fn,
    free_ports,
    is_healthy,
    make_log_dir,
    terminate,
    url_of,
)
from disagg.config import API_KEY_ENV, CLUSTER_TOKEN_ENV, env_cluster_token, resolve_api_key

__all__ = [
    "Cluster",
    "ClusterConfig",
    "add_arguments",
    "api_key_env",
    "config_from_args",
    "free_ports",
    "run",
]

HEALTH_POLL_S = 0.2  # between /health probes and child liveness checks
MAX_PORT_ATTEMPTS = 3  # a picked port can be taken between our probe and the child's bind


class Cluster:
    """Router + instances as child processes of this one; a context manager (start, then stop).

    Start it from a thread that outlives the cluster: PR_SET_PDEATHSIG fires when the *thread*
    that spawned a child exits, not only the process.
    """

    def __init__(self, config: ClusterConfig, *, echo: Callable[[str], None] | None = None):
        self.config = config
        self.log_dir: Path | None = None  # set by start()
        self._echo = echo or (lambda _line: None)
        self._instances: list[Child] = []
        self._router: Child | None = None
        # One secret per cluster (or the operator's): signs every call between the children.
        self._cluster_token = cluster_token()
        self._secret_env: dict[str, str] = {}  # the API key, read by start()

    @property
    def url(self) -> str:
        assert self._router is not None, "start() first"
        return self._router.url

    @property
    def port(self) -> int:
        """The router's port (the one picked when config.port is 0)."""
        assert self._router is not None, "start() first"
        return self._router.port

    @property
    def instance_urls(self) -> dict[str, list[str]]:
        """Serve role ("both" | "prefill" | "decode") -> instance base URLs, in start order."""
        urls: dict[str, list[str]] = {}
        for child in self._instances:
            urls.setdefault(child.role, []).append(child.url)
        return urls

    @property
    def pids(self) -> dict[str, int]:
        """Process name ("both-0", ..., "router") -> pid of its latest attempt."""
        return {c.name: c.proc.pid for c in self._children if c.proc is not None}

    @property
    def _children(self) -> list[Child]:
        return [*self._instances, *([self._router] if self._router else [])]

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> str:
        """Start every instance, then the router; block until all are healthy. -> router URL.

        RuntimeError (with the failing child's last log lines) when a child exits, the startup
        timeout passes or `should_stop()` turns true; everything started is stopped first.
        """
        try:
            return self._start(should_stop)
        except BaseException:
            self.stop()
            raise

    def _start(self, should_stop: Callable[[], bool]) -> str:
        assert not self._children, "a Cluster starts once; make a new one to restart"
        deadline = time.monotonic() + self.config.startup_timeout_s
        if self.config.port:  # fail before loading models, and never mistake another server's
            check_port_free(self.config.host, self.config.port)  # /health for our router's
        self._secret_env = api_key_env(self.config)
        model_dir = resolve_model_dir(self.config.model)
        self.log_dir = make_log_dir(self.config.log_dir)
        self._echo(f"disagg up: logs in {self.log_dir}")
        self._instances = self._plan_instances(model_dir)
        for child in self._instances:
            self._spawn(child)
        self._wait_healthy(self._instances, deadline, should_stop)
        self._router = self._plan_router()
        self._spawn(self._router)
        self._wait_healthy([self._router], deadline, should_stop)
        dead = self.dead_process()
        if dead is not None:  # healthy once, then gone while the others were starting
            raise RuntimeError(dead)
        return self.url

    def dead_process(self) -> str | None:
        """A report on the first child that has exited, None while all are running."""
        for child in self._children:
            if child.proc is not None and child.proc.poll() is not None:
                return child.exit_report()
        return None

    def stop(self) -> None:
        """Router first (no new requests reach dying instances), then every instance.

        Each stage: SIGTERM, wait up to stop_timeout_s, SIGKILL. Idempotent.
        """
        if self._router is not None:
            terminate([self._router], self.config.stop_timeout_s)
        terminate(self._instances, self.config.stop_timeout_s)

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _plan_instances(self, model_dir: Path) -> list[Child]:
        assert self.log_dir is not None
        cfg = self.config
        roles = [role for role, count in cfg.roles for _ in range(count)]
        ports = free_ports(len(roles))
        children = []
        for role, port in zip(roles, ports, strict=True):
            name = f"{role}-{sum(c.role == role for c in children)}"

            def command(port: int, role: str = role) -> list[str]:
                return cfg.serve_command(role, model_dir, port)

            log_path = self.log_dir / f"{name}.log"
            children.append(Child(name, role, command, cfg.host, port, log_path))
        return children

    def _plan_router(self) -> Child:
        assert self.log_dir is not None
        urls = self.instance_urls
        port = self.config.port or free_ports(1)[0]

        def command(port: int) -> list[str]:
            return self.config.route_command(urls, port)

        log_path = self.log_dir / "router.log"
        is_ours = self.config.port == 0
        return Child("router", "router", command, self.config.host, port, log_path, is_ours)

    def _spawn(self, child: Child) -> None:
        child.log_offset = child.log_path.stat().st_size if child.log_path.exists() else 0
        child.num_attempts += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the log tail must be current on failure
        env[CLUSTER_TOKEN_ENV] = self._cluster_token  # in the environment: `ps` shows argv
        env.update(self._secret_env)
        with open(child.log_path, "ab") as log:  # the child keeps its own descriptor
            child.proc = subprocess.Popen(
                child.make_command(child.port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=False,  # a signal to the launcher's group reaches them too
                preexec_fn=die_with_parent_fn(),
            )
        self._echo(
            f"disagg up: {child.name} pid {child.proc.pid} on {child.url}, log {child.log_path}"
        )

    def _wait_healthy(
        self, children: list[Child], deadline: float, should_stop: Callable[[], bool]
    ) -> None:
        pending = list(children)
        while pending:
            if should_stop():
                raise RuntimeError("startup interrupted")
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                timeout_s = self.config.startup_timeout_s
                raise RuntimeError(
                    f"not healthy after {timeout_s:g} s: {names}; see {self.log_dir}"
                )
            for child in list(pending):
                if self._check_running(child) and is_healthy(f"{child.url}/health"):
                    pending.remove(child)
            time.sleep(HEALTH_POLL_S)

    def _check_running(self, child: Child) -> bool:
        """True if running; respawns on another port after a clash; RuntimeError otherwise."""
        assert child.proc is not None
        if child.proc.poll() is None:
            return True
        is_clash = "address already in use" in child.log_tail().lower()
        if not (is_clash and child.is_port_ours and child.num_attempts < MAX_PORT_ATTEMPTS):
            raise RuntimeError(child.exit_report(" during startup"))
        self._echo(f"disagg up: {child.name}: port {child.port} was taken, retrying")
        child.port = free_ports(1)[0]
        self._spawn(child)
        return False


def cluster_token() -> str:
    """The operator's cluster secret ($DISAGG_CLUSTER_TOKEN), else a fresh one for this cluster."""
    return env_cluster_token() or secrets.token_urlsafe(32)


def api_key_env(config: ClusterConfig) -> dict[str, str]:
    """{$DISAGG_API_KEY: the key} for the children when the key is in a file (they inherit it
    from our own environment otherwise). RuntimeError if the file cannot be read."""
    if config.api_key_file is None:
        return {}
    try:
        return {API_KEY_ENV: resolve_api_key("", config.api_key_file)}
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc


def resolve_model_dir(model: str) -> Path:
    """Convert a short name once, here, so that N instances don't all race to convert it."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()  # a ready directory: no need to import torch in the launcher
    from disagg.engine.checkpoint import resolve_model

    try:
        return resolve_model(model).resolve()
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot resolve model {model!r}: {exc}") from exc


# --------------------------------------------------------------------------- command line


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
