"""Time the project's KV transport (`disagg.kv.transport`) between two registered buffers.

An initiator here and a target in a spawned process (as a decode instance reads from a
prefill instance; the in-process `local` transport keeps both here), moving blocks of the
model's KV block size through the `Transport` contract only: READs of n
scattered blocks (n descriptors) and of n contiguous ones (one run). A least-squares fit of

    post-to-done = fixed + per descriptor x descriptors + bytes / bandwidth

gives the profile's transfer figures; the share of that time spent inside `post()` says
whether the copy happens there (NIXL over cross-memory attach does it in the caller's thread).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from disagg.kv.transport import Op, TransferState, Transport, make_transport

__all__ = ["TransportFit", "measure_transport"]

_PAGE = 4096
_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class TransportFit:
    kind: str  # which transport was timed
    block_nbytes: int
    fixed_s: float  # per transfer: post bookkeeping, completion, poll
    per_descriptor_s: float
    bandwidth: float  # bytes/s
    post_share: float  # median fraction of post-to-done spent inside post()
    num_transfers: int

    @property
    def is_copy_in_post(self) -> bool:
        return self.post_share > 0.5


def _buffer(nbytes: int) -> np.ndarray:
    raw = np.ones(nbytes + _PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _PAGE
    return raw[offset : offset + nbytes]


def _scattered(rng: np.random.Generator, num_blocks: int, n: int) -> list[int]:
    """n distinct even block ids: no two adjacent, so nothing can merge into one run."""
    return (2 * rng.permutation(num_blocks // 2)[:n]).tolist()


def _time_read(
    initiator: Transport, peer: str, local: list[int], remote: list[int]
) -> tuple[float, float]:
    """(seconds inside post, seconds post-to-done) of one READ."""
    start = time.perf_counter()
    handle = initiator.post(Op.READ, peer, local, remote, b"calibrate")
    posted = time.perf_counter()
    while (state := initiator.poll(handle)) is TransferState.PROC:
        if time.perf_counter() - start > _TIMEOUT_S:
            raise TimeoutError("calibration transfer did not finish")
    done = time.perf_counter()
    initiator.release(handle)
    if state is not TransferState.DONE:
        raise RuntimeError(f"calibration transfer ended {state.value}")
    return posted - start, done - start


def _fit(rows: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """rows of (descriptors, bytes, seconds) -> (fixed_s, per_descriptor_s, bandwidth),
    least squares on relative error."""
    seconds = np.asarray([s for _, _, s in rows])
    x = np.asarray([[1.0, d, b] for d, b, _ in rows]) / seconds[:, None]
    scale = x.max(axis=0)
    coef = np.linalg.lstsq(x / scale, np.ones(len(rows)), rcond=None)[0] / scale
    fixed, per_desc, per_byte = (max(float(c), 0.0) for c in coef)
    return fixed, per_desc, 1.0 / per_byte if per_byte > 0 else 1e30


def _target_main(conn: Connection, kind: str, num_blocks: int, block_nbytes: int) -> None:
    """The target process: registers its buffer, answers with its metadata, waits for close."""
    buf = _buffer(num_blocks * block_nbytes)
    transport = make_transport(kind, "calibrate-target")
    transport.register(buf.ctypes.data, num_blocks, block_nbytes)
    conn.send(transport.metadata())
    conn.recv()  # close
    transport.close()


@contextmanager
def _target(kind: str, num_blocks: int, block_nbytes: int) -> Iterator[bytes]:
    """The target's metadata; `local` lives in this process, the others in a spawned one."""
    if kind == "local":
        buf = _buffer(num_blocks * block_nbytes)
        transport = make_transport(kind, "calibrate-target")
        transport.register(buf.ctypes.data, num_blocks, block_nbytes)
        try:
            yield transport.metadata()
        finally:
            transport.close()
        return
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(child, kind, num_blocks, block_nbytes))
    proc.start()
    try:
        if not conn.poll(_TIMEOUT_S):
            raise TimeoutError("calibration target did not start")
        yield conn.recv()
    finally:
        conn.send("close")
        proc.join(_TIMEOUT_S)


def _time_count(
    initiator: Transport, peer: str, local: list[int], remote: list[int], repeats: int
) -> tuple[float, float]:
    """(median seconds post-to-done, median share of it spent inside post()) of one case."""
    times = [_time_read(initiator, peer, local, remote) for _ in range(repeats)]
    return statistics.median(t for _, t in times), statistics.median(p / t for p, t in times)


def measure_transport(
    kind: str, block_nbytes: int, counts: tuple[int, ...] = (1, 4, 16, 64, 256), repeats: int = 9
) -> TransportFit:
    num_blocks = 2 * max(counts)
    buf = _buffer(num_blocks * block_nbytes)
    initiator = make_transport(kind, "calibrate-initiator")
    rng = np.random.default_rng(0)
    rows: list[tuple[int, int, float]] = []
    shares: list[float] = []
    try:
        with _target(kind, num_blocks, block_nbytes) as target_metadata:
            initiator.register(buf.ctypes.data, num_blocks, block_nbytes)
            peer = initiator.add_peer(target_metadata).name
            _time_read(initiator, peer, [0], [0])  # connection set-up is not a transfer's cost
            for n in counts:
                scattered = (_scattered(rng, num_blocks, n), _scattered(rng, num_blocks, n), n)
                contiguous = (list(range(n)), list(range(num_blocks - n, num_blocks)), 1)
                for local, remote, num_descriptors in (scattered, contiguous):
                    seconds, share = _time_count(initiator, peer, local, remote, repeats)
                    rows.append((num_descriptors, n * block_nbytes, seconds))
                    shares.append(share)
    finally:
        initiator.close()
    fixed, per_desc, bandwidth = _fit(rows)
    return TransportFit(
        kind, block_nbytes, fixed, per_desc, bandwidth, statistics.median(shares), len(rows)
    )
