"""abuse_bench.py's last step: one aggregated instance alone under RLIMIT_AS 3.5 GB gets a
10 MB text prompt and a 10 MB chat prompt, then a normal request; whether it is alive after
each, and its memory (VmRSS, VmHWM, VmPeak).

Starts and stops its own child (not the launcher's: the limit is set before exec).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from abuse_attacks import big_text
from abuse_clients import VICTIM_PROMPT, error_message, request
from abuse_stats import to_ms
from child_procs import HOST, START_TIMEOUT_S, die_with_parent, memory_mib, ready_url, reap

LIMITED_PROMPT_CHARS = 10_000_000
ADDRESS_SPACE_BYTES = int(3.5 * 2**30)  # the limit the instance died under before


def _limited_child() -> None:
    die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def _wait_ready(popen: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while popen.poll() is None and time.monotonic() < deadline:
        url = ready_url(log_path)
        if url and request(url, "GET", "/health")[0] == 200:
            return url
        time.sleep(0.2)
    raise RuntimeError(f"limited instance did not start:\n{log_path.read_text()[-3000:]}")


def run_limited(model_dir: Path, log_dir: Path) -> dict[str, Any]:
    """An aggregated instance under RLIMIT_AS 3.5 GB: a 10 MB text and chat prompt, then a
    normal request; alive after each, and its memory."""
    log_path = log_dir / "limited.log"
    argv = [sys.executable, "-m", "disagg.cli", "serve", "--model", str(model_dir)]
    argv += ["--host", HOST, "--port", "0", "--num-threads", "1", "--role", "both"]
    argv += ["--dtype", "float32"]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, preexec_fn=_limited_child)  # fmt: skip
    try:
        url = _wait_ready(popen, log_path)
        before = memory_mib(popen.pid)
        sent = _big_prompts(url, popen)
        after = memory_mib(popen.pid) if popen.poll() is None else {}
        normal = {"prompt": VICTIM_PROMPT, "max_tokens": 4, "temperature": 0}
        status, _, _ = request(url, "POST", "/v1/completions", json.dumps(normal).encode())
        return {"address_space_limit_gib": ADDRESS_SPACE_BYTES / 2**30, "requests": sent,
                "normal_request_status": status, "alive_at_end": popen.poll() is None,
                "memory_mib_before": before, "memory_mib_after": after}  # fmt: skip
    finally:
        popen.terminate()
        reap(popen)


def _big_prompts(url: str, popen: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
    """The 10 MB text and chat prompts, one after the other: each answer, and alive after it."""
    text = big_text(LIMITED_PROMPT_CHARS)
    chat = {"messages": [{"role": "user", "content": text}]}
    sent = []
    for name, path, body in (("10 MB text prompt", "/v1/completions", {"prompt": text}),
                             ("10 MB chat prompt", "/v1/chat/completions", chat)):  # fmt: skip
        status, raw, elapsed_s = request(url, "POST", path, json.dumps(body).encode())
        sent.append({"attack": name, "status": status, "latency_ms": to_ms(elapsed_s),
                     "message": error_message(raw),
                     "alive_after": popen.poll() is None})  # fmt: skip
    return sent
