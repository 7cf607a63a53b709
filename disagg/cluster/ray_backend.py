"""`disagg up --backend ray`: the same cluster as `disagg up`, placed and kept alive by Ray.

Every process of the cluster (the router and each instance) is the child of one Ray actor, on
whichever node Ray places that actor: an instance asks for one GPU where the Ray cluster has
GPUs, a share of a CPU otherwise. Nothing here manages a cluster: Ray places and restarts, the
router's live membership wires the pieces together. The router starts first on a known port;
each instance runs `disagg serve --router URL` at its node's address and registers itself.

If a child dies, its actor exits and Ray restarts the actor (up to MAX_RESTARTS), which starts
the child again; an instance re-registers and the router sends it work again. Teardown drains
every instance (SIGTERM: it finishes what it holds, then deregisters), stops the router, kills
the actors and, when this command started Ray itself, shuts Ray down. `ray` is an optional
dependency (`pip install 'disagg[ray]'`); `disagg up` and `disagg scale` import this module
only for this backend.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disagg.cluster.config import ClusterConfig
from disagg.cluster.prepare import api_key_env, cluster_token, make_log_dir, resolve_model_dir
from disagg.cluster.processes import die_with_parent_fn, free_port, wait_healthy
from disagg.config import ServerConfig

__all__ = ["INSTANCE_NAME", "NAMESPACE", "RayCluster", "import_ray", "run", "start_actor"]

NAMESPACE = "disagg"  # actors are named (router, prefill-0, decode-0, ...) in this namespace
MAX_RESTARTS = 3
NODE_IP = "{node_ip}"  # replaced, inside each actor, by the address of the node it runs on
CPU_SHARE = 0.1  # logical CPUs an actor reserves where there is no GPU: all fit on one host
_READY = re.compile(r"ready on (http://\S+)")
INSTANCE_NAME = re.compile(r"^(prefill|decode|both)-(\d+)$")  # actor names: role-index
_POLL_S = 0.1


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(
            "the ray backend needs Ray, which is not installed: pip install 'disagg[ray]'"
        ) from exc
    return ray


class ChildProcess:
    """A Ray actor's body: run one command as a child, and die with it so Ray restarts us."""

    def __init__(
        self, argv: list[str], env: dict[str, str], log_path: str, options: dict[str, Any]
    ) -> None:
        import ray

        self.template = (argv, env, options)  # what `disagg scale` copies to add a sibling
        node_ip = ray.util.get_node_ip_address()
        self.argv = [arg.replace(NODE_IP, node_ip) for arg in argv]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._is_stopping = False
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                preexec_fn=die_with_parent_fn(),  # the actor's death takes the child along
            )
        threading.Thread(target=self._exit_with_child, daemon=True).start()

    def _exit_with_child(self) -> None:
        self.proc.wait()
        if not self._is_stopping:
            os._exit(1)  # an unexpected exit: Ray restarts this actor, which restarts the child

    def url(self, timeout_s: float) -> str:
        """The child's URL, once it printed its ready line (RuntimeError if it never does)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                found = _READY.search(log.read().decode(errors="replace"))
            if found:
                return found.group(1)
            time.sleep(_POLL_S)
        raise RuntimeError(f"{self.argv[3:5]} not ready after {timeout_s:g}s; see {self.log_path}")

    def pid(self) -> int:
        return self.proc.pid

    def spec(self) -> tuple[list[str], dict[str, str], dict[str, Any], str]:
        """(argv before node substitution, env, actor options, log directory)."""
        return (*self.template, str(self.log_path.parent))

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (an instance drains first), SIGKILL after timeout_s; the exit code."""
        self._is_stopping = True
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class RayCluster:
    """The router and instances of a ClusterConfig as Ray actors; start() then stop()."""

    def __init__(
        self,
        config: ClusterConfig,
        model_dir: Path,
        log_dir: Path,
        cluster_token: str,
        address: str | None,
        echo: Callable[[str], None],
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.env = {"DISAGG_CLUSTER_TOKEN": cluster_token}
        self.address = address
        self._echo = echo
        self._ray: Any = None
        self._started_ray = False
        self.router: Any = None
        self.instances: dict[str, Any] = {}  # actor name -> handle
        self.url = ""

    def start(self) -> str:
        ray = self._ray = import_ray()
        if self.address:
            ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False)
        else:  # a local Ray on this host, bound to the cluster's address, stopped with us
            ray.init(_node_ip_address=self.config.host, namespace=NAMESPACE,
                     include_dashboard=False, log_to_driver=False)  # fmt: skip
            self._started_ray = True
        has_gpus = ray.cluster_resources().get("GPU", 0) >= 1
        self.url = self._start_router()
        for name, argv in self._instance_commands():
            self.instances[name] = self._actor(name, argv, gpus=1 if has_gpus else 0)
        deadline = time.monotonic() + self.config.startup_timeout_s
        ray.get([a.url.remote(self.config.startup_timeout_s) for a in self.instances.values()])
        # Healthy once every role has registered a healthy instance.
        if not wait_healthy(f"{self.url}/health", deadline):
            raise RuntimeError(f"the router at {self.url} never had every role ready")
        return self.url

    def stop(self) -> None:
        """Drain the instances, stop the router, then the actors (and Ray, if ours)."""
        ray = self._ray
        if ray is None:
            return
        timeout_s = self.config.stop_timeout_s + ServerConfig().drain_timeout_s  # instances' own
        instances = [*self.instances.values(), *self._scaled_in(ray)]
        stops = [a.stop.remote(timeout_s) for a in instances]
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s + 10)
        if self.router is not None:
            ray.wait([self.router.stop.remote(self.config.stop_timeout_s)], timeout=30)
        for actor in [*instances, *([self.router] if self.router else [])]:
            ray.kill(actor, no_restart=True)
        if self._started_ray:
            ray.shutdown()
        self._ray = None

    def _start_router(self) -> str:
        port = self.config.port or free_port()
        argv = self.config.route_command({}, port)
        if argv[-1] == "--decode":  # no instance to name: they register themselves
            argv.pop()
        argv[argv.index("--host") + 1] = self._host()
        self.router = self._actor("router", argv, gpus=0)
        return self._ray.get(self.router.url.remote(self.config.startup_timeout_s))

    def _instance_commands(self) -> list[tuple[str, list[str]]]:
        commands = []
        for role, count in self.config.roles:
            for index in range(count):
                argv = self.config.serve_command(role, self.model_dir, 0)
                host = self._host()
                argv[argv.index("--host") + 1] = host
                argv += ["--router", self.url]
                argv += ["--kv-host", host] if role != "both" else []
                commands.append((f"{role}-{index}", argv))
        return commands

    def _scaled_in(self, ray: Any) -> list[Any]:
        """Instances `disagg scale` added (detached: they outlive its driver)."""
        names = [
            n
            for n in ray.util.list_named_actors()
            if INSTANCE_NAME.match(n) and n not in self.instances
        ]
        found = []
        for name in names:
            try:
                found.append(ray.get_actor(name))
            except ValueError:  # gone since it was listed
                continue
        return found

    def _host(self) -> str:
        """Where a process listens: the cluster's host on a local Ray (one machine, bound
        where the user said), its node's address when joining a Ray cluster."""
        return NODE_IP if self.address else self.config.host

    def _actor(self, name: str, argv: list[str], gpus: int) -> Any:
        options: dict[str, Any] = {"num_gpus": gpus} if gpus else {"num_cpus": CPU_SHARE}
        actor = start_actor(self._ray, name, argv, self.env, options, self.log_dir)
        self._echo(f"disagg up: {name} as a Ray actor, log {self.log_dir / f'{name}.log'}")
        return actor


def start_actor(
    ray: Any,
    name: str,
    argv: list[str],
    env: dict[str, str],
    options: dict[str, Any],
    log_dir: Path,
) -> Any:
    """A named ChildProcess actor running `argv`; Ray restarts it up to MAX_RESTARTS times."""
    remote = ray.remote(ChildProcess).options(name=name, max_restarts=MAX_RESTARTS, **options)
    return remote.remote(argv, env, str(log_dir / f"{name}.log"), options)


def run(config: ClusterConfig, should_stop: Callable[[], bool], echo: Callable[[str], None]) -> int:
    """`disagg up --backend ray` until SIGINT/SIGTERM; the exit code."""
    model_dir = resolve_model_dir(config.model)
    log_dir = make_log_dir(config.log_dir)
    echo(f"disagg up: logs in {log_dir}")
    address = config.ray_address or None
    cluster = RayCluster(config, model_dir, log_dir, cluster_token(), address, echo)
    try:
        cluster.env.update(api_key_env(config))  # the actors' environment, never their argv
        url = cluster.start()
        roles = ", ".join(f"{n} {r}" for r, n in config.roles)
        echo(f"disagg up ready on {url} (backend ray, mode {config.mode}: {roles})")
        while not should_stop():
            time.sleep(_POLL_S)
        echo("disagg up: stopping: draining the instances, then the router and Ray")
        return 0
    except RuntimeError as exc:
        echo(f"disagg up: {exc}")
        return 1
    finally:
        cluster.stop()
