"""KV transport throughput between two processes: raw NIXL agents vs our nixl and tcp transports.

Moves `--total-mib` per transfer as scattered blocks (random permutations on both sides, so NIXL
cannot merge neighbours) for each block size, READ and WRITE, and reports GB/s and the time spent
inside post() (the part that sits on an engine loop). Prints a table; the last stdout line is the
JSON document (also written to --out). Measures only; it must not tune anything.

    python benchmarks/transport_bench.py [--block-kib 16,256] [--total-mib 64] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from disagg.kv.transport import Op, Transport, make_transport
from disagg.kv.transport.nixl import create_nixl_agent

_PAGE = 4096
_POLL_SLEEP_S = 0.0001  # yield the GIL between polls so tcp's worker thread can run
_TIMEOUT_S = 30.0


def _aligned_buffer(nbytes: int, seed: int) -> np.ndarray:
    """Page-aligned uint8 buffer whose 8-byte words are seed-offset counters (cheap to check)."""
    raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _PAGE
    buf = raw[offset : offset + nbytes]
    buf.view(np.uint64)[:] = np.arange(nbytes // 8, dtype=np.uint64) + np.uint64(seed << 40)
    return buf


# ---- the target process ----------------------------------------------------------------------


def _target_main(conn: Connection, nbytes: int) -> None:
    """Owns the target buffer; builds what the initiator asks for and answers with metadata."""
    buf = _aligned_buffer(nbytes, seed=2)
    keep: list[Any] = []  # agents and transports stay alive until "close"
    while True:
        cmd, args = conn.recv()
        if cmd == "raw":
            agent = create_nixl_agent("bench-raw-target")
            agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
            keep.append(agent)
            conn.send((agent.get_agent_metadata(), buf.ctypes.data))
        elif cmd == "transport":
            kind, block_nbytes = args
            transport = make_transport(kind, f"bench-target-{kind}-{block_nbytes}")
            transport.register(buf.ctypes.data, nbytes // block_nbytes, block_nbytes)
            keep.append(transport)
            conn.send(transport.metadata())
        elif cmd == "close":
            for obj in keep:
                if hasattr(obj, "close"):
                    obj.close()
            conn.send(None)
            return


class _Target:
    def __init__(self, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target_main, args=(child, nbytes), daemon=True)
        self._proc.start()

    def ask(self, cmd: str, *args: Any) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(60.0):
            raise TimeoutError(f"target did not answer {cmd!r} within 60 s")
        return self._conn.recv()

    def close(self) -> None:
        try:
            self.ask("close")
        finally:
            self._proc.join(10.0)
            if self._proc.is_alive():
                self._proc.kill()


# ---- timing ----------------------------------------------------------------------------------


def _time_transfers(
    post: Callable[[list[int], list[int]], Any],
    poll: Callable[[Any], str],
    release: Callable[[Any], None],
    num_blocks: int,
    iters: int,
    seed: int,
) -> tuple[list[float], list[float]]:
    """-> (post seconds, post-to-done seconds) per iteration, after one warm-up transfer."""
    rng = np.random.default_rng(seed)
    post_s, total_s = [], []
    for i in range(iters + 1):
        local, remote = rng.permutation(num_blocks).tolist(), rng.permutation(num_blocks).tolist()
        start = time.perf_counter()
        handle = post(local, remote)
        posted = time.perf_counter()
        while (state := poll(handle)) == "PROC":
            if time.perf_counter() - start > _TIMEOUT_S:
                raise TimeoutError("transfer did not finish")
            time.sleep(_POLL_SLEEP_S)
        done = time.perf_counter()
        release(handle)
        if state != "DONE":
            raise RuntimeError(f"transfer ended {state}")
        if i:  # the first one pays connection set-up
            post_s.append(posted - start)
            total_s.append(done - start)
    return post_s, total_s


def _block_descs(base_addr: int, num_blocks: int, block_nbytes: int) -> np.ndarray:
    descs = np.zeros((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_nbytes)
    descs[:, 1] = block_nbytes
    return descs


def _check_read(buf: np.ndarray, block_nbytes: int, local: list[int], remote: list[int]) -> bool:
    """After READ local <- remote: each local block holds the target's counters for its block."""
    words = block_nbytes // 8
    view = buf.view(np.uint64).reshape(-1, words)
    for lid, rid in zip(local, remote, strict=True):
        expected = np.arange(rid * words, (rid + 1) * words, dtype=np.uint64) + np.uint64(2 << 40)
        if not np.array_equal(view[lid], expected):
            return False
    return True


def _row(system: str, op: str, block_nbytes: int, num_blocks: int, post_s: list[float],
         total_s: list[float], descs: int, verified: bool) -> dict[str, Any]:  # fmt: skip
    gbps = [num_blocks * block_nbytes / t / 1e9 for t in total_s]
    return {
        "system": system,
        "op": op,
        "block_kib": block_nbytes // 1024,
        "num_blocks": num_blocks,
        "total_mib": num_blocks * block_nbytes // 2**20,
        "gbps_median": round(statistics.median(gbps), 3),
        "gbps_best": round(max(gbps), 3),
        "post_ms_median": round(statistics.median(post_s) * 1e3, 3),
        "xfer_ms_median": round(statistics.median(total_s) * 1e3, 3),
        "num_descriptors": descs,
        "verified": verified,
    }


class _RawNixl:
    """NIXL agents used directly, as in the notes: one region, prepped lists per block size,
    make_prepped_xfer + transfer per transfer."""

    def __init__(self, target: _Target, buf: np.ndarray) -> None:
        self.buf = buf
        self.agent = create_nixl_agent("bench-raw-initiator")
        self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        remote_md, self.remote_base = target.ask("raw")
        self.remote = self.agent.add_remote_agent(remote_md).decode()

    def bench(self, block_nbytes: int, op: str, iters: int) -> dict[str, Any]:
        num_blocks = self.buf.nbytes // block_nbytes
        local_descs = _block_descs(self.buf.ctypes.data, num_blocks, block_nbytes)
        local_dl = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM")
        remote_descs = _block_descs(self.remote_base, num_blocks, block_nbytes)
        remote_dl = self.agent.prep_xfer_dlist(self.remote, remote_descs, "DRAM")
        descs: list[int] = []

        def post(local: list[int], remote: list[int]) -> Any:
            lidx, ridx = np.asarray(local, np.int32), np.asarray(remote, np.int32)
            handle = self.agent.make_prepped_xfer(op, local_dl, lidx, remote_dl, ridx)
            return handle, self.agent.transfer(handle, b"raw")

        def poll(posted: Any) -> str:
            return posted[1] if posted[1] != "PROC" else self.agent.check_xfer_state(posted[0])

        def release(posted: Any) -> None:
            descs.append(self.agent.get_xfer_telemetry(posted[0]).descCount)
            self.agent.release_xfer_handle(posted[0])

        post_s, total_s = _time_transfers(post, poll, release, num_blocks, iters, seed=7)
        ids = np.random.default_rng(3).permutation(num_blocks)[:8].tolist()
        _time_transfers(lambda lo, re: post(ids, ids[::-1]), poll, release, num_blocks, 0, 0)
        verified = op != "READ" or _check_read(self.buf, block_nbytes, ids, ids[::-1])
        local_dl.release()
        remote_dl.release()
        return _row("raw-nixl", op, block_nbytes, num_blocks, post_s, total_s, descs[0], verified)


def _bench_transport(
    kind: str, target: _Target, buf: np.ndarray, block_nbytes: int, ops: list[str], iters: int
) -> list[dict[str, Any]]:
    """One of our transports, through the Transport contract only."""
    num_blocks = buf.nbytes // block_nbytes
    transport: Transport = make_transport(kind, f"bench-initiator-{kind}-{block_nbytes}")
    try:
        transport.register(buf.ctypes.data, num_blocks, block_nbytes)
        peer = transport.add_peer(target.ask("transport", kind, block_nbytes)).name
        return [_bench_op(transport, peer, buf, block_nbytes, op, iters) for op in ops]
    finally:
        transport.close()


def _bench_op(
    transport: Transport, peer: str, buf: np.ndarray, block_nbytes: int, op: str, iters: int
) -> dict[str, Any]:
    num_blocks = buf.nbytes // block_nbytes
    descs: list[int] = []

    def release(handle: int) -> None:
        descs.append(transport.num_descriptors(handle))
        transport.release(handle)

    def poll(handle: int) -> str:
        return transport.poll(handle).value

    def post(local: list[int], remote: list[int]) -> int:
        return transport.post(Op(op), peer, local, remote, b"bench")

    post_s, total_s = _time_transfers(post, poll, release, num_blocks, iters, seed=7)
    ids = np.random.default_rng(3).permutation(num_blocks)[:8].tolist()
    _time_transfers(lambda lo, re: post(ids, ids[::-1]), poll, release, num_blocks, 0, 0)
    verified = op != "READ" or _check_read(buf, block_nbytes, ids, ids[::-1])
    name = f"ours-{type(transport).__name__.removesuffix('Transport').lower()}"
    return _row(name, op, block_nbytes, num_blocks, post_s, total_s, descs[0], verified)


# ---- main ------------------------------------------------------------------------------------

_COLUMNS = [
    ("system", 10), ("op", 6), ("block_kib", 10), ("num_blocks", 11), ("gbps_median", 12),
    ("gbps_best", 10), ("post_ms_median", 15), ("xfer_ms_median", 15), ("num_descriptors", 16),
]  # fmt: skip


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("".join(f"{name:>{width}}" for name, width in _COLUMNS))
    for row in rows:
        print("".join(f"{row[name]!s:>{width}}" for name, width in _COLUMNS))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", default="16,256", help="comma-separated block sizes")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per transfer")
    parser.add_argument("--iters", type=int, default=5, help="timed transfers per case")
    parser.add_argument("--systems", default="raw-nixl,nixl,tcp", help="what to measure")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = args.total_mib * 2**20
    block_sizes = [int(kib) * 1024 for kib in args.block_kib.split(",")]
    systems = args.systems.split(",")
    ops = ["READ", "WRITE"]
    buf = _aligned_buffer(nbytes, seed=1)
    target = _Target(nbytes)
    rows: list[dict[str, Any]] = []
    try:
        raw = _RawNixl(target, buf) if "raw-nixl" in systems else None
        for block_nbytes in block_sizes:
            if raw is not None:
                rows += [raw.bench(block_nbytes, op, args.iters) for op in ops]
            for kind in (k for k in ("nixl", "tcp") if k in systems):
                rows += _bench_transport(kind, target, buf, block_nbytes, ops, args.iters)
    finally:
        target.close()
    config = {"total_mib": args.total_mib, "iters": args.iters, "cpus": os.cpu_count()}
    config["ucx_tls"] = os.environ.get("UCX_TLS", "default")
    return {"config": config, "results": rows}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    start = time.perf_counter()
    result = run(args)
    result["config"]["wall_s"] = round(time.perf_counter() - start, 2)
    _print_table(result["results"])
    doc = json.dumps(result)
    if args.out is not None:
        args.out.write_text(doc + "\n")
    print(doc)
    return 0 if all(row["verified"] for row in result["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
