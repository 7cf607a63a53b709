"""The local backend of `disagg up`: instances, then the router, as children of this process.

Owns the cluster's plan and order: which children, on which ports, healthy in time, stopped
router first. children.py holds each child's record and its termination, processes.py the
ports, health probes and dying with the launcher, prepare.py what is settled before the first
child starts. Serving and routing live in the children.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from disagg.cluster.children import Child, terminate
from disagg.cluster.config import ClusterConfig
from disagg.cluster.prepare import api_key_env, cluster_token, make_log_dir, resolve_model_dir
from disagg.cluster.processes import (
    HEALTH_POLL_S,
    StartStop,
    check_port_free,
    die_with_parent_fn,
    free_port,
    free_ports,
    is_healthy,
)
from disagg.config import CLUSTER_TOKEN_ENV

__all__ = ["Cluster"]

MAX_PORT_ATTEMPTS = 3  # a picked port can be taken between our probe and the child's bind


class Cluster(StartStop):
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
        self._router = self._plan_router(model_dir)
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

    def _plan_router(self, model_dir: Path) -> Child:
        assert self.log_dir is not None
        urls = self.instance_urls
        port = self.config.port or free_port()

        def command(port: int) -> list[str]:
            return self.config.route_command(urls, port, model_dir)

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
        child.port = free_port()
        self._spawn(child)
        return False
