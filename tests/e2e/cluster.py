"""Real `disagg serve` / `disagg route` processes for the end-to-end tests.

Owns child processes only: each binds port 0 on 127.0.0.1 and prints its address; every wait
has a deadline; teardown is SIGTERM, then SIGKILL; children die with the test process
(PR_SET_PDEATHSIG); the tail of each child's log explains a failure. Requests go through
tests/e2e/client.py. Never imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.client import CLUSTER_TOKEN, complete, http_request

__all__ = [
    "Cluster",
    "Proc",
    "Reference",
    "assert_pools_full",
    "running_cluster",
]

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0  # a cold start imports torch; several start at once on two cores
STOP_TIMEOUT_S = 10.0  # SIGTERM -> exit; then SIGKILL
POOL_TIMEOUT_S = 10.0  # blocks are freed asynchronously (notifications, aborts, leases)
LOG_TAIL_LINES = 25
_READY = re.compile(rb"ready on (https?://[\w.\-]+:\d+)")
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# ---- processes -------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the test process (the spawning thread) exits."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _child_setup(preexec: Callable[[], None] | None) -> None:
    _die_with_parent()
    if preexec is not None:
        preexec()


@dataclass(slots=True, eq=False)
class Proc:
    """One child: an engine instance or a router."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    url: str = ""  # known once the child printed its ready line
    tls_context: ssl.SSLContext | None = None  # verifies an https child (internal TLS)

    # ---- lifecycle

    @property
    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def poll_ready(self) -> bool:
        """True once the child listens and answers /health with 200."""
        if not self.url:
            found = _READY.search(self.log_path.read_bytes())
            if found is None:
                return False
            self.url = found.group(1).decode()
        try:
            return self.get_status("/health") == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; returns once the child is gone."""
        if self.is_alive:
            self.popen.terminate()
        try:
            self.popen.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the process dies without any cleanup (a crash, as far as peers can tell)."""
        if self.is_alive:
            self.popen.kill()
        self.popen.wait(STOP_TIMEOUT_S)

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-num_lines:])

    def describe(self) -> str:
        state = "running" if self.is_alive else f"exited {self.popen.returncode}"
        return (
            f"--- {self.name} ({state}, {self.url or 'no url'}) {self.log_path}\n{self.log_tail()}"
        )

    # ---- HTTP

    def get_status(self, path: str) -> int:
        return http_request(self.url, "GET", path, None, timeout_s=2.0, context=self.tls_context)[0]

    def get_json(self, path: str) -> Any:
        status, raw = http_request(
            self.url, "GET", path, None, timeout_s=5.0, context=self.tls_context
        )
        assert status == 200, f"{self.name} GET {path}: HTTP {status}: {raw[:200]!r}"
        return json.loads(raw)

    def load(self) -> dict[str, int]:
        return self.get_json("/load")

    def kv_info(self) -> dict[str, Any]:
        return self.get_json("/kv_info")

    def stats(self) -> dict[str, float]:
        """The KV connector's counters (transfers, expired_leases, handshakes_refused...)."""
        return self.kv_info()["stats"]

    def num_finished(self, finish_reason: str) -> float:
        """Requests this instance finished with `finish_reason` ("length", "abort", "error")."""
        status, raw = http_request(
            self.url, "GET", "/metrics", None, timeout_s=5.0, context=self.tls_context
        )
        assert status == 200, f"{self.name} GET /metrics: HTTP {status}"
        line = f'disagg_requests_total{{finish_reason="{finish_reason}"}} '
        found = [row for row in raw.decode().splitlines() if row.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0


class Cluster:
    """The children of one test module; `stop()` stops them (by default every one)."""

    def __init__(self, log_dir: Path, model_dir: Path) -> None:
        self.log_dir = log_dir
        self.model_dir = model_dir
        self.procs: list[Proc] = []
        self.tls_context: ssl.SSLContext | None = None  # children started from now on use it

    def serve(
        self,
        name: str,
        *,
        role: str = "both",
        connector: str = "pull",
        transport: str = "nixl",
        model_dir: Path | None = None,
        dtype: str = "float32",
        args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> Proc:
        """Start `disagg serve` (one torch thread, a free port); does not wait for it.
        `preexec` runs in the child before exec (e.g. to set a resource limit).

        fp32 unless asked: the e2e tests compare text token for token across runs batched and
        chunked differently (P's prefill in 32-token chunks vs the aggregated one in one), and
        in bf16 two schedules round differently; the bf16 engine has its own tests."""
        argv = ["serve", "--model", str(model_dir or self.model_dir), "--host", HOST]
        argv += ["--port", "0", "--num-threads", "1", "--role", role, "--dtype", dtype]
        if role != "both":
            argv += ["--kv-connector", connector, "--kv-transport", transport, "--kv-host", HOST]
        return self._spawn(name, [*argv, *args], env, preexec)

    def route(
        self,
        name: str,
        prefill: Iterable[Proc],
        decode: Iterable[Proc],
        *,
        mode: str,
        policy: str = "round_robin",
        args: Iterable[str] = (),
    ) -> Proc:
        """Start `disagg route` over ready instances and wait until it is ready too."""
        argv = ["route", "--host", HOST, "--port", "0", "--mode", mode, "--policy", policy]
        argv += ["--prefill", *(p.url for p in prefill)] if mode != "aggregated" else []
        argv += ["--decode", *(d.url for d in decode), *args]
        router = self._spawn(name, argv)
        self.wait_ready(router)
        return router

    def _spawn(
        self,
        name: str,
        args: list[str],
        extra_env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> Proc:
        log_path = self.log_dir / f"{name}-{len(self.procs)}.log"
        argv = [sys.executable, "-m", "disagg.cli", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["DISAGG_CLUSTER_TOKEN"] = CLUSTER_TOKEN
        env.update(extra_env or {})
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=lambda: _child_setup(preexec),  # run in the child before exec
            )
        proc = Proc(name, argv, log_path, popen, tls_context=self.tls_context)
        self.procs.append(proc)
        return proc

    def wait_ready(self, *procs: Proc, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every given child (default: every one started) answers /health."""
        waiting = [p for p in (procs or self.procs) if p.is_alive or not p.url]
        deadline = time.monotonic() + timeout_s
        while waiting:
            for proc in list(waiting):
                if not proc.is_alive:
                    raise RuntimeError(f"{proc.name} exited during start\n{proc.describe()}")
                if proc.poll_ready():
                    waiting.remove(proc)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(p.name for p in waiting)
                raise TimeoutError(f"not ready after {timeout_s}s: {names}\n{self.describe()}")
            time.sleep(_POLL_S)

    def stop(self, *procs: Proc) -> None:
        """Stop the given children (default: all), all at once: SIGTERM, wait, SIGKILL."""
        targets = list(procs or self.procs)
        for proc in targets:
            if proc.is_alive:
                proc.popen.terminate()
        for proc in targets:
            proc.stop()

    def describe(self) -> str:
        """Every child's state and log tail, for a failure report."""
        return "\n".join(proc.describe() for proc in self.procs)


@contextlib.contextmanager
def running_cluster(
    request: pytest.FixtureRequest, name: str, model_dir: Path
) -> Iterator[Cluster]:
    """A Cluster for one fixture scope: its children are stopped on exit, and their log tails
    are printed to the terminal when a test failed while they ran."""
    log_dir = request.getfixturevalue("tmp_path_factory").mktemp(name)
    cluster = Cluster(log_dir, model_dir)
    num_failed = request.session.testsfailed
    try:
        yield cluster
    finally:
        if request.session.testsfailed > num_failed:
            _print_to_terminal(request, f"\n===== {name}: children's logs\n{cluster.describe()}")
        cluster.stop()


def _print_to_terminal(request: pytest.FixtureRequest, text: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(text)
    else:
        print(text, file=sys.stderr)


# ---- pools -----------------------------------------------------------------------------------


def assert_pools_full(*procs: Proc, timeout_s: float = POOL_TIMEOUT_S) -> None:
    """Every pool back to full (frees are asynchronous, so poll until the deadline)."""
    deadline = time.monotonic() + timeout_s
    loads: dict[str, dict[str, int]] = {}
    while True:
        loads = {p.name: p.load() for p in procs if p.is_alive}
        leaking = {
            n: ld for n, ld in loads.items() if ld["num_free_blocks"] != ld["num_total_blocks"]
        }
        if not leaking:
            return
        if time.monotonic() > deadline:
            tails = "\n".join(p.describe() for p in procs)
            raise AssertionError(f"blocks still held after {timeout_s}s: {leaking}\n{tails}")
        time.sleep(_POLL_S)


# ---- reference answers ---------------------------------------------------------------------


class Reference:
    """The aggregated instance's text for a request body, asked once per body."""

    def __init__(
        self, cluster: Cluster, aggregated: Proc, *, headers: dict[str, str] | None = None
    ) -> None:
        self._cluster = cluster
        self._aggregated = aggregated
        self._headers = headers  # e.g. the instance's API key
        self._texts: dict[str, str] = {}

    def __call__(self, body: dict[str, Any]) -> str:
        key = json.dumps(body, sort_keys=True)
        if key not in self._texts:
            self._cluster.wait_ready(self._aggregated)
            answer = complete(
                self._aggregated.url, {**body, "stream": False}, headers=self._headers
            )
            self._texts[key] = answer.text
        return self._texts[key]
