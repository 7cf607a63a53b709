"""One KV handoff taken apart: setup vs transfer, pull vs push over NIXL, against raw NIXL.

Writes a mid-size random checkpoint (Qwen3, 8 layers, 4 KV heads of 64: 16 KiB of fp32 KV per
token, so 4096 tokens are 64 MiB), starts a prefill and a decode instance and a router per mode
(one torch thread each), and sends greedy streamed requests of 256, 1024 and 4096 prompt tokens
one at a time, each prompt new (no prefix-cache hits). Each handoff's stages come from the
response's `disagg.breakdown`; TTFT is the client's. Then raw NIXL READ (what pull does) and
WRITE (what push does) of the same bytes in the same block size, in this run, with
benchmarks/transport_bench.py. KV throughput = bytes / transfer_s, and bytes / (setup +
transfer) for the handoff's whole critical path. Prints a table; the last stdout line is the
JSON document (also written to --out). Measures only; it tunes nothing.

    python benchmarks/handoff_bench.py [--sizes 256,1024,4096] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import transport_bench  # benchmarks/ is on sys.path when this file runs as a script

_CLUSTER_TOKEN = f"handoff-bench-{os.getpid()}-{random.getrandbits(64):x}"

_HOST = "127.0.0.1"
_READY = re.compile(rb"ready on (http://[\w.\-]+:\d+)")
_START_TIMEOUT_S = 180.0
_REQUEST_TIMEOUT_S = 300.0
_MODEL = {  # 2 * 8 layers * 4 KV heads * 64 * 4 bytes = 16 KiB of KV per token
    "arch": "qwen3",
    "num_layers": 8,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1024,
    "vocab_size": 2048,
    "seed": 0,
}
_STAGES = ("queue_s", "prefill_s", "handoff_setup_s", "transfer_s", "decode_wait_s")


# ---- processes -------------------------------------------------------------------------------


class _Child:
    """A `disagg serve` or `disagg route` child on a free port, logging to a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.setdefault("DISAGG_CLUSTER_TOKEN", _CLUSTER_TOKEN)  # signs the instances' calls
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "disagg.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.url = ""

    def wait_ready(self, deadline: float) -> None:
        while not self._is_ready():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} did not start:\n{tail}")
            time.sleep(0.2)

    def _is_ready(self) -> bool:
        found = _READY.search(self.log_path.read_bytes())
        if found is None:
            return False
        self.url = found.group(1).decode()
        try:
            return _get_json(self.url, "/health").get("status") == "ok"
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def _serve_args(model_dir: Path, role: str, mode: str) -> list[str]:
    return [
        "serve", "--model", str(model_dir), "--host", _HOST, "--port", "0",
        "--num-threads", "1", "--max-model-len", "8192", "--role", role,
        "--kv-connector", mode, "--kv-transport", "nixl", "--kv-host", _HOST,
    ]  # fmt: skip


def _start_mode(model_dir: Path, mode: str, log_dir: Path) -> list[_Child]:
    """[prefill, decode, router] of one mode, all ready."""
    prefill = _Child(f"prefill-{mode}", _serve_args(model_dir, "prefill", mode), log_dir)
    decode = _Child(f"decode-{mode}", _serve_args(model_dir, "decode", mode), log_dir)
    deadline = time.monotonic() + _START_TIMEOUT_S
    for child in (prefill, decode):
        child.wait_ready(deadline)
    route = ["route", "--host", _HOST, "--port", "0", "--mode", mode]
    route += ["--prefill", prefill.url, "--decode", decode.url]
    router = _Child(f"router-{mode}", route, log_dir)
    router.wait_ready(deadline)
    return [prefill, decode, router]


# ---- HTTP ------------------------------------------------------------------------------------


def _connect(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=_REQUEST_TIMEOUT_S)


def _get_json(url: str, path: str) -> Any:
    conn = _connect(url)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _stream(url: str, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    """One greedy streamed request -> (client TTFT seconds, the final chunk's breakdown)."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    conn = _connect(url)
    started = time.perf_counter()
    ttft_s, breakdown = None, None
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: ") :])
            if "error" in event:
                raise RuntimeError(f"request failed: {event['error']}")
            ttft_s = ttft_s or time.perf_counter() - started
            breakdown = event.get("disagg", {}).get("breakdown", breakdown)
    finally:
        conn.close()
    if ttft_s is None or breakdown is None:
        raise RuntimeError("stream ended without a token or a breakdown")
    return ttft_s, breakdown


# ---- measuring -------------------------------------------------------------------------------


def _measure_mode(
    model_dir: Path, mode: str, sizes: list[int], repeats: int, log_dir: Path
) -> tuple[list[dict[str, Any]], int]:
    """Per-request samples of one mode, and the engine's bytes per KV block."""
    children = _start_mode(model_dir, mode, log_dir)
    prefill, _, router = children
    rng = random.Random(f"handoff-{mode}")

    def prompt(num_tokens: int) -> list[int]:
        return [rng.randrange(3, _MODEL["vocab_size"]) for _ in range(num_tokens)]

    try:
        block_nbytes = int(_get_json(prefill.url, "/kv_info")["compat"]["block_nbytes"])
        _stream(router.url, prompt(64))  # warm-up: first contact (handshake, NIXL wire-up)
        samples = []
        for num_tokens in sizes:
            for _ in range(repeats):
                ttft_s, breakdown = _stream(router.url, prompt(num_tokens))
                samples.append({"mode": mode, "prompt_tokens": num_tokens, "ttft_s": ttft_s,
                                **breakdown})  # fmt: skip
        return samples, block_nbytes
    finally:
        for child in reversed(children):
            child.stop()


def _raw_nixl(sizes_bytes: list[int], block_nbytes: int, iters: int) -> dict[tuple[str, int], Any]:
    """(op, bytes) -> transport_bench's raw-NIXL row: two agents in two processes, scattered
    blocks of `block_nbytes`, moving exactly `bytes` per transfer."""
    largest = max(sizes_bytes)
    buf = transport_bench._aligned_buffer(largest, seed=1)
    target = transport_bench._Target(largest)
    rows: dict[tuple[str, int], Any] = {}
    try:
        raw = transport_bench._RawNixl(target, buf)
        for nbytes in sizes_bytes:
            raw.buf = buf[:nbytes]  # the first nbytes of both registered buffers
            for op in ("READ", "WRITE"):
                rows[(op, nbytes)] = raw.bench(block_nbytes, op, iters)
    finally:
        target.close()
    return rows


def _median(samples: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(values) if values else None


def _summarize(
    samples: list[dict[str, Any]], raw: dict[tuple[str, int], Any]
) -> list[dict[str, Any]]:
    rows = []
    for mode, num_tokens in sorted({(s["mode"], s["prompt_tokens"]) for s in samples}):
        group = [s for s in samples if s["mode"] == mode and s["prompt_tokens"] == num_tokens]
        for s in group:
            s["kv_gbps"] = s["num_bytes"] / s["transfer_s"] / 1e9 if s["transfer_s"] else None
            s["path_gbps"] = s["num_bytes"] / (s["handoff_setup_s"] + s["transfer_s"]) / 1e9
        num_bytes = int(group[0]["num_bytes"])
        raw_row = raw[("READ" if mode == "pull" else "WRITE", num_bytes)]
        row = {"mode": mode, "prompt_tokens": num_tokens, "num_requests": len(group)}
        row |= {f"{key}_ms": _ms(_median(group, key)) for key in (*_STAGES, "ttft_s")}
        row |= {
            "kv_mib": round(num_bytes / 2**20, 2),
            "num_descriptors": _median(group, "num_descriptors"),
            "kv_gbps": _round(_median(group, "kv_gbps")),
            "path_gbps": _round(_median(group, "path_gbps")),
            "raw_op": raw_row["op"],
            "raw_gbps": raw_row["gbps_median"],
            "raw_ms": raw_row["xfer_ms_median"],
            "raw_num_descriptors": raw_row["num_descriptors"],
        }
        row["kv_vs_raw"] = _round(row["kv_gbps"] / row["raw_gbps"]) if row["kv_gbps"] else None
        row["path_vs_raw"] = _round(row["path_gbps"] / row["raw_gbps"])
        rows.append(row)
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# ---- main ------------------------------------------------------------------------------------

_COLUMNS = [
    ("mode", 5), ("prompt_tokens", 7), ("kv_mib", 7), ("prefill_s_ms", 10),
    ("handoff_setup_s_ms", 9), ("transfer_s_ms", 8), ("ttft_s_ms", 9), ("num_descriptors", 6),
    ("kv_gbps", 8), ("path_gbps", 9), ("raw_op", 6), ("raw_gbps", 9), ("raw_ms", 8),
    ("kv_vs_raw", 9), ("path_vs_raw", 11),
]  # fmt: skip
_HEADERS = {
    "prompt_tokens": "tokens", "handoff_setup_s_ms": "setup_ms", "transfer_s_ms": "xfer_ms",
    "prefill_s_ms": "prefill_ms", "ttft_s_ms": "ttft_ms", "num_descriptors": "descs",
}  # fmt: skip
_NOTES = """\
kv_gbps = bytes / transfer_s; path_gbps = bytes / (handoff_setup_s + transfer_s), the handoff's
critical path. raw = transport_bench's raw NIXL agents, same bytes and block size, scattered
blocks. Where NIXL completes a transfer inside the post call (UCX over CMA copies in the
caller's thread), pull's copy runs in D's setup (on its engine loop) and its transfer_s is only
the poll that sees DONE; push's copy runs on P's writer thread, inside D's transfer_s (post ->
write_done seen at D, notification latency included)."""


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("".join(f"{_HEADERS.get(name, name):>{width + 1}}" for name, width in _COLUMNS))
    for row in rows:
        print("".join(f"{row[name]!s:>{width + 1}}" for name, width in _COLUMNS))
    print(_NOTES)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,4096", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="requests per (mode, size)")
    parser.add_argument("--modes", default="pull,push")
    parser.add_argument("--raw-iters", type=int, default=5, help="raw NIXL transfers per case")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from disagg.engine.make_model import write_checkpoint  # torch: only once we run

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="handoff-bench-") as tmp:
        model_dir = write_checkpoint(Path(tmp) / "model", **_MODEL)
        samples: list[dict[str, Any]] = []
        for mode in args.modes.split(","):
            mode_samples, block_nbytes = _measure_mode(
                model_dir, mode, sizes, args.repeats, Path(tmp)
            )
            samples += mode_samples
    sizes_bytes = sorted({int(s["num_bytes"]) for s in samples})
    raw = _raw_nixl(sizes_bytes, block_nbytes, args.raw_iters)
    config = {"model": _MODEL, "block_nbytes": block_nbytes, "repeats": args.repeats}
    config |= {"raw_iters": args.raw_iters, "cpus": os.cpu_count(), "num_threads": 1}
    config["ucx_tls"] = os.environ.get("UCX_TLS", "default")
    return {"config": config, "results": _summarize(samples, raw), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    _print_table(result["results"])
    doc = json.dumps(result)
    if args.out is not None:
        args.out.write_text(doc + "\n")
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
