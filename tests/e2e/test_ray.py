"""End to end: `disagg up --backend ray` on a local Ray bound to 127.0.0.1, in pull and push
mode: greedy outputs equal the aggregated baseline's; killing the decode instance's actor
mid-load hangs no client, Ray restarts it, it re-registers and serves again; SIGINT tears
everything down and leaves no Ray process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from tests.e2e.client import Answer, complete, completion_body, prompt_ids
from tests.e2e.cluster import Cluster, Reference
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

UP_TIMEOUT_S = 240.0
RAY_PROCESSES = re.compile(rb"raylet|gcs_server|ray::|dashboard_agent|runtime_env_agent")


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, check=True).stdout
    return [line.decode() for line in out.splitlines() if RAY_PROCESSES.search(line)]


def start_up(cluster: Cluster, mode: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    argv = [sys.executable, "-m", "disagg.cli", "up", "--backend", "ray", "--mode", mode]
    argv += ["--model", str(cluster.model_dir), "--port", "0", "--host", "127.0.0.1"]
    argv += ["--log-dir", str(log.parent / f"logs-{mode}"), "--", "--dtype", "float32"]
    with open(log, "wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    found = wait_until(
        lambda: (
            up.poll() is None
            and re.search(rb"ready on (http://\S+)", log.read_bytes())
            or (up.poll() is not None and pytest.fail(log.read_text()))
        ),
        "disagg up --backend ray to be ready",
        UP_TIMEOUT_S,
    )
    return up, found.group(1).decode()


def kill_decode_actor() -> None:
    ray.init(address="auto", namespace="disagg", log_to_driver=False)
    try:
        ray.kill(ray.get_actor("decode-0"), no_restart=False)  # Ray restarts it
    finally:
        ray.shutdown()


def scale(count: int) -> None:
    argv = [sys.executable, "-m", "disagg.cli", "scale", "--address", "auto", "--role", "decode"]
    done = subprocess.run([*argv, "--count", str(count)], capture_output=True, text=True,
                          timeout=UP_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def scale_up_then_drain_under_load(url: str, long_body: dict) -> None:
    """`disagg scale` adds a decode instance that takes work, then drains it away while three
    long requests run: each finishes whole."""
    scale(2)
    wait_until(lambda: len(decode_urls(url)) == 2, "two decode instances")
    with ThreadPoolExecutor(3) as clients:
        running = [clients.submit(complete, url, long_body, timeout_s=120.0) for _ in range(3)]
        time.sleep(0.3)
        scale(1)  # drains decode-1: no new work, its requests finish, then it goes
        answers = [f.result(timeout=180) for f in running]
    assert [a.status for a in answers] == [200] * 3, [a.body for a in answers]
    assert all(a.body["usage"]["completion_tokens"] == 600 for a in answers)
    assert len(decode_urls(url)) == 1


def decode_urls(router_url: str) -> list[str]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{router_url}/instances", timeout=5) as resp:
        rows = json.loads(resp.read())
    return [r["url"] for r in rows if r["role"] == "decode" and r["healthy"]]


def decode_url(router_url: str) -> str | None:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{router_url}/instances", timeout=5) as resp:
        rows = json.loads(resp.read())
    healthy = [r["url"] for r in rows if r["role"] == "decode" and r["healthy"]]
    return healthy[0] if healthy else None


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_ray_backend_serves_restarts_and_tears_down(
    mode: str, cluster: Cluster, reference: Reference, tmp_path: Path
) -> None:
    bodies = [completion_body(prompt_ids(seed, 40), 12) for seed in range(3)]
    expected = [reference(body) for body in bodies]
    assert not ray_processes(), "a Ray from before this test is still running"
    up, url = start_up(cluster, mode, tmp_path / "up.log")
    try:
        assert [complete(url, body).text for body in bodies] == expected

        first_decode = decode_url(url)
        long_body = completion_body(prompt_ids(7, 40), 600)
        with ThreadPoolExecutor(3) as clients:  # a hung client fails `result` below
            running = [clients.submit(complete, url, long_body, timeout_s=120.0) for _ in range(3)]
            time.sleep(0.3)  # the requests are decoding
            kill_decode_actor()
            answers: list[Answer] = [f.result(timeout=180) for f in running]
        assert all(a.status == 200 or a.status >= 500 for a in answers), answers

        wait_until(lambda: (u := decode_url(url)) and u != first_decode, "the restarted decode")
        assert [complete(url, body).text for body in bodies] == expected
        if mode == "push":
            scale_up_then_drain_under_load(url, long_body)
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 0
    wait_until(lambda: not ray_processes(), "every Ray process to exit", 60.0)
