"""One conformance suite for every transport (local, tcp, nixl): the contract in base.py.

For tcp and nixl the peers are separate processes; `me` is a transport in the test process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from disagg.kv.transport import Op, TransferState, Transport, TransportError, make_transport
from tests.kv.transport_peer import (
    BLOCK_NBYTES,
    NUM_BLOCKS,
    Peer,
    make_buffer,
    pattern,
    wait_done,
)

KINDS = ["local", "tcp", "nixl"]
PEER_SEED = 2  # the peer buffer's pattern; other seeds mark what a test moved


@dataclass
class Env:
    kind: str
    me: Transport
    buffer: np.ndarray  # [NUM_BLOCKS, BLOCK_NBYTES], registered with `me`
    peer: Peer  # knows `me` (add_peer both ways)
    victim: Peer  # a second peer, for the death/restart test


@pytest.fixture(scope="module", params=KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    kind = request.param
    peer = Peer(kind, f"peer-{kind}", PEER_SEED)
    victim = Peer(kind, f"victim-{kind}", 3)  # both processes start while we build `me`
    buffer = make_buffer()
    me = make_transport(kind, f"me-{kind}")
    try:
        me.register(buffer.ctypes.data, NUM_BLOCKS, BLOCK_NBYTES)
        info = me.add_peer(peer.metadata)
        assert (info.name, info.num_blocks, info.block_nbytes) == (
            peer.name,
            NUM_BLOCKS,
            BLOCK_NBYTES,
        )
        assert peer.call("add_peer", me.metadata()) == me.name
        yield Env(kind, me, buffer, peer, victim)
    finally:
        me.close()
        peer.close()
        victim.close()


def _ids(seed: int, count: int) -> list[int]:
    """`count` distinct block ids in scrambled order: scattered, like a real paged KV layout."""
    return np.random.default_rng(seed).permutation(NUM_BLOCKS)[:count].tolist()


def _drain_notifs(me: Transport, count: int, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    """Collect `count` notifs (bounded), then watch 0.2 s more for duplicates."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got += me.get_notifs()
        if len(got) >= count:
            deadline = min(deadline, time.monotonic() + 0.2)
        time.sleep(0.001)
    return got


def test_read_scattered_blocks(env: Env) -> None:
    env.buffer[:] = 0
    env.peer.call("fill", PEER_SEED)
    local, remote = _ids(10, 20), _ids(11, 20)
    handle = env.me.post(Op.READ, env.peer.name, local, remote, b"read-1")
    assert wait_done(env.me, handle) is TransferState.DONE
    np.testing.assert_array_equal(env.buffer[local], pattern(PEER_SEED)[remote])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local))
    assert not env.buffer[untouched].any(), "READ wrote outside the requested blocks"
    assert 1 <= env.me.num_descriptors(handle) <= len(local)
    env.me.release(handle)
    seen = env.peer.call("wait_notifs", {b"read-1": []}, 5.0)
    assert seen == {b"read-1": (1, env.me.name, b"")}  # once, from us


def test_write_notif_arrives_once_after_bytes(env: Env) -> None:
    env.buffer[:] = pattern(5)
    env.peer.call("fill", PEER_SEED)
    local, remote = _ids(20, 24), _ids(21, 24)
    handle = env.me.post(Op.WRITE, env.peer.name, local, remote, b"write-1")
    assert wait_done(env.me, handle) is TransferState.DONE  # NIXL's notif leaves on our poll
    seen = env.peer.call("wait_notifs", {b"write-1": remote}, 5.0)
    count, sender, snapshot = seen[b"write-1"]
    assert (count, sender) == (1, env.me.name)
    assert snapshot == pattern(5)[local].tobytes(), "notif seen before the bytes landed"
    env.me.release(handle)
    others = sorted(set(range(NUM_BLOCKS)) - set(remote))
    assert env.peer.call("blocks", others) == pattern(PEER_SEED)[others].tobytes()


def test_peer_read_notifies_us_after_its_bytes_landed(env: Env) -> None:
    env.buffer[:] = pattern(6)
    local, remote = _ids(30, 16), _ids(31, 16)
    assert env.peer.call("post_wait", "READ", env.me.name, local, remote, b"peer-read") == "DONE"
    assert _drain_notifs(env.me, 1) == [(env.peer.name, b"peer-read")]
    assert env.peer.call("blocks", local) == pattern(6)[remote].tobytes()


def test_send_notif_both_ways(env: Env) -> None:
    env.me.send_notif(env.peer.name, b"hello")
    seen = env.peer.call("wait_notifs", {b"hello": []}, 5.0)
    assert seen == {b"hello": (1, env.me.name, b"")}
    env.peer.call("send_notif", env.me.name, b"back")
    assert _drain_notifs(env.me, 1) == [(env.peer.name, b"back")]


def test_many_transfers_in_flight(env: Env) -> None:
    env.buffer[:] = pattern(7)
    local, remote = _ids(40, NUM_BLOCKS), _ids(41, NUM_BLOCKS)
    chunks = {
        f"m{i}".encode(): (local[4 * i : 4 * i + 4], remote[4 * i : 4 * i + 4]) for i in range(16)
    }
    handles = [
        env.me.post(Op.WRITE, env.peer.name, lo, re, msg) for msg, (lo, re) in chunks.items()
    ]
    assert [wait_done(env.me, h) for h in handles] == [TransferState.DONE] * 16
    expected = {msg: re for msg, (_, re) in chunks.items()}
    seen = env.peer.call("wait_notifs", expected, 10.0)
    assert sorted(seen) == sorted(chunks)
    for msg, (lo, _) in chunks.items():
        count, sender, snapshot = seen[msg]
        assert (count, sender) == (1, env.me.name), msg
        assert snapshot == pattern(7)[lo].tobytes(), msg
    for handle in handles:
        env.me.release(handle)


def test_bad_arguments_raise(env: Env) -> None:
    me, peer = env.me, env.peer.name
    bad_calls = {
        "unknown peer": lambda: me.post(Op.READ, "nobody", [0], [0], b""),
        "local id too big": lambda: me.post(Op.READ, peer, [NUM_BLOCKS], [0], b""),
        "remote id too big": lambda: me.post(Op.WRITE, peer, [0], [NUM_BLOCKS], b""),
        "negative id": lambda: me.post(Op.WRITE, peer, [-1], [0], b""),
        "length mismatch": lambda: me.post(Op.READ, peer, [0, 1], [0], b""),
        "no blocks": lambda: me.post(Op.READ, peer, [], [], b""),
        "unknown handle": lambda: me.poll(10**9),
        "notif to unknown peer": lambda: me.send_notif("nobody", b"x"),
        "garbage metadata": lambda: me.add_peer(b"garbage"),
    }
    for what, call in bad_calls.items():
        try:
            call()
        except TransportError:
            continue
        pytest.fail(f"{what}: no TransportError")
    assert env.peer.call("wait_notifs", {}, 0.2) == {}, "a refused post still notified"


def test_remove_peer_then_add_again(env: Env) -> None:
    env.buffer[:] = 0
    env.peer.call("fill", PEER_SEED)
    env.me.remove_peer(env.peer.name)
    with pytest.raises(TransportError):
        env.me.post(Op.READ, env.peer.name, [0], [0], b"")
    env.me.add_peer(env.peer.metadata)
    handle = env.me.post(Op.READ, env.peer.name, [5, 3], [7, 60], b"")
    assert wait_done(env.me, handle) is TransferState.DONE
    np.testing.assert_array_equal(env.buffer[[5, 3]], pattern(PEER_SEED)[[7, 60]])
    env.me.release(handle)


def _post_to_dead(me: Transport, peer: str) -> tuple[TransferState | None, float]:
    """-> (final state, or None if post raised; seconds it took to settle)."""
    start = time.monotonic()
    try:
        handle = me.post(Op.WRITE, peer, [1, 2], [3, 4], b"to-the-dead")
    except TransportError:
        return None, time.monotonic() - start
    state = wait_done(me, handle, timeout_s=15.0)
    if state is not TransferState.PROC:
        me.release(handle)
    return state, time.monotonic() - start


def test_dead_peer_fails_fast_and_restart_reconnects(env: Env) -> None:
    env.buffer[:] = pattern(8)
    name = env.victim.name
    env.me.add_peer(env.victim.metadata)
    handle = env.me.post(Op.WRITE, name, [0], [0], b"")
    assert wait_done(env.me, handle) is TransferState.DONE
    env.me.release(handle)
    # (1) the peer dies: transfers to it fail, quickly, and never hang
    env.victim.kill()
    for _ in range(2):
        state, elapsed_s = _post_to_dead(env.me, name)
        assert state in (None, TransferState.ERR), f"transfer to a dead peer ended {state}"
        assert elapsed_s < 15.0
    # (2) it restarts under the same name: add_peer with its new metadata reconnects
    restarted = Peer(env.kind, name, 4)
    try:
        env.me.add_peer(restarted.metadata)
        handle = env.me.post(Op.READ, name, [10, 11], [33, 2], b"")
        assert wait_done(env.me, handle) is TransferState.DONE
        np.testing.assert_array_equal(env.buffer[[10, 11]], pattern(4)[[33, 2]])
        env.me.release(handle)
        handle = env.me.post(Op.WRITE, name, [20], [50], b"hi-again")
        assert wait_done(env.me, handle) is TransferState.DONE
        seen = restarted.call("wait_notifs", {b"hi-again": [50]}, 5.0)
        assert seen == {b"hi-again": (1, env.me.name, pattern(8)[[20]].tobytes())}
    finally:
        restarted.close()


def test_closed_transport_raises(env: Env) -> None:
    """Runs last for each kind (tests keep file order within a fixture param)."""
    env.me.close()
    for call in (
        env.me.metadata,
        lambda: env.me.post(Op.READ, env.peer.name, [0], [0], b""),
        env.me.get_notifs,
        lambda: env.me.send_notif(env.peer.name, b"x"),
    ):
        with pytest.raises(TransportError):
            call()


def test_factory_rejects_unknown_kind_and_device_memory_without_nixl() -> None:
    with pytest.raises(ValueError, match="kind"):
        make_transport("carrier-pigeon", "x")
    for kind in ("tcp", "local"):
        with pytest.raises(ValueError, match="host memory"):
            make_transport(kind, "x", device="cuda:0")
