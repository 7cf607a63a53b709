"""The soak's children: the PLAN of instances, one `disagg serve` / `disagg route` child each
on a free port, started until ready and stopped routers first.

Only starts, watches and stops processes; what is sent to them is soak_load.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from child_procs import HOST, START_TIMEOUT_S, die_with_parent, proc_status, ready_url, reap
from soak_http import request

from disagg.kv.faults import KVFaults

ROUTER_MAX_BYTES = 256 * 1024  # the routers' body limit; "huge body" goes past it
API_KEY = "soak-" + secrets.token_urlsafe(16)  # router-push's, from $DISAGG_API_KEY
RECOMPUTE = ("--failure-policy", "recompute")
FAULTY = {"pull-decode-1", "pull-decode-2"}  # every transfer they start fails (kv/faults.py)
PLAN = [  # name, role, connector, extra flags
    ("reference", "both", "", ()),
    ("push-prefill", "prefill", "push", ()),
    ("push-decode-0", "decode", "push", ()),  # killed in the middle third
    ("push-decode-1", "decode", "push", RECOMPUTE),
    ("pull-prefill", "prefill", "pull", ()),
    ("pull-decode-0", "decode", "pull", ()),
    ("pull-decode-1", "decode", "pull", RECOMPUTE),  # faulty: always recomputes
    ("pull-decode-2", "decode", "pull", ()),  # faulty: always fails, with an error
]
VICTIM = "push-decode-0"


class Child:
    """A `disagg serve` / `disagg route` child on a free port, logging to a file."""

    def __init__(
        self, name: str, args: list[str], log_dir: Path, token: str, api_key: str = ""
    ) -> None:
        self.name, self.url, self.log_path = name, "", log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if name in FAULTY:  # this child only: the hook is read from its own environment
            env.update(KVFaults(fail_transfer=True).as_env())
        env["DISAGG_CLUSTER_TOKEN"] = token  # the cluster secret, as `disagg up` hands it over
        env.pop("DISAGG_API_KEY", None)
        if api_key:
            env["DISAGG_API_KEY"] = api_key  # never on the command line
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "disagg.cli", *args], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent,
            )  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, deadline: float) -> None:
        while not self._is_ready():
            if not self.alive or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} did not start:\n{tail}")
            time.sleep(0.2)

    def _is_ready(self) -> bool:
        url = ready_url(self.log_path)
        if url:
            self.url = url
            with contextlib.suppress(OSError):
                return request(self.url, "GET", "/health", timeout_s=2)[0] == 200
        return False

    def proc_stats(self) -> dict[str, float]:
        """RSS (MiB), threads and open file descriptors, from /proc."""
        fds = len(os.listdir(f"/proc/{self.popen.pid}/fd"))
        threads = int(proc_status(self.popen.pid)["Threads"])
        return {"rss_mib": self.rss_mib(), "threads": threads, "fds": fds}

    def rss_mib(self) -> float:
        return round(int(proc_status(self.popen.pid)["VmRSS"].split()[0]) / 1024, 1)


def start_children(
    model_dir: Path, args: argparse.Namespace, log_dir: Path, started: list[Child], token: str
) -> None:
    """Every instance of PLAN, then the two routers, all ready; each appended to `started`."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for name, role, connector, extra in PLAN:
        argv = _serve_argv(model_dir, args, role, connector, extra)
        started.append(Child(name, argv, log_dir, token))
    for child in started:
        child.wait_ready(deadline)
    urls = {child.name: child.url for child in started}
    for mode in ("push", "pull"):
        argv = ["route", "--host", HOST, "--port", "0", "--mode", mode]
        argv += ["--max-request-bytes", str(ROUTER_MAX_BYTES), "--prefill", urls[f"{mode}-prefill"]]
        argv += ["--decode", *(url for n, url in urls.items() if n.startswith(f"{mode}-decode"))]
        api_key = API_KEY if mode == "push" else ""  # odd Authorization headers meet a key
        started.append(Child(f"router-{mode}", argv, log_dir, token, api_key))
        started[-1].wait_ready(deadline)


def _serve_argv(
    model_dir: Path, args: argparse.Namespace, role: str, connector: str, extra: tuple[str, ...]
) -> list[str]:
    argv = ["serve", "--model", str(model_dir), "--host", HOST, "--port", "0"]
    # fp32: "wrong text" compares tokens with the reference, and in bf16 (the default where
    # the CPU has it) two batch compositions round differently, so a busy machine would
    # report batching as corruption.
    argv += ["--num-threads", "1", "--role", role, "--dtype", "float32", *extra]
    if role != "both":
        argv += ["--kv-connector", connector, "--kv-transport", args.transport]
        argv += ["--kv-host", HOST]
    return argv


def stop_children(children: list[Child]) -> None:
    """Routers first, then instances: SIGTERM to all, wait, SIGKILL what is left."""
    for child in reversed(children):
        if child.alive:
            child.popen.terminate()
    for child in reversed(children):
        reap(child.popen)
