"""The TCP KV transport serves blocks only to peers that prove the cluster's shared secret.

Every test plays one attack against a real TcpTransport listener on loopback: a raw socket
that speaks the request frames without the handshake, a transport holding the wrong secret
(or none), a replayed handshake, an eavesdropper, and a client that connects and stays silent.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from disagg.kv.transport import Op, TransferState
from disagg.kv.transport.tcp import TcpTransport
from disagg.kv.transport.tcp_auth import HELLO, PROOF
from disagg.kv.transport.tcp_wire import OP_READ, OP_WRITE, encode_request
from tests.helpers import wait_until
from tests.kv.transport_peer import BLOCK_NBYTES, NUM_BLOCKS, make_buffer, pattern, wait_done

SECRET = "cluster-secret-for-tests"
IO_TIMEOUT_S = 1.0  # small, so a refused or silent connection is closed quickly
IDS = [3, 17, 40, 63]


class Node:
    """A TcpTransport with its own registered buffer filled with pattern(seed)."""

    def __init__(self, name: str, secret: str | None, seed: int) -> None:
        self.buffer = make_buffer()
        self.buffer[:] = pattern(seed)
        self.transport = TcpTransport(name, io_timeout_s=IO_TIMEOUT_S, secret=secret)
        self.transport.start()
        self.transport.register(self.buffer.ctypes.data, NUM_BLOCKS, BLOCK_NBYTES)

    @property
    def addr(self) -> tuple[str, int]:
        body = json.loads(self.transport.metadata()[4:])
        return body["host"], body["port"]


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        node.transport.close()


def _node(nodes: list[Node], name: str, secret: str | None, seed: int) -> Node:
    node = Node(name, secret, seed)
    nodes.append(node)
    return node


def _knows(a: Node, b: Node) -> None:
    a.transport.add_peer(b.transport.metadata())


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the server sends until it hangs up -> (bytes, whether it hung up in time)."""
    data = bytearray()
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            break
        except ConnectionResetError:  # closed with our unread request still in its buffer
            return bytes(data), True
        if not chunk:
            return bytes(data), True
        data += chunk
    return bytes(data), False


def _leaks(received: bytes, victim: np.ndarray, ids: list[int]) -> list[int]:
    """Ids of the victim's blocks any 64-byte piece of which shows up in `received`."""
    pieces = {
        i: [victim[i, o : o + 64].tobytes() for o in range(0, BLOCK_NBYTES, 4096)] for i in ids
    }
    return [i for i, chunks in pieces.items() if any(c in received for c in chunks)]


def _settle(node: Node, op: Op, peer: str, local: list[int], remote: list[int]) -> TransferState:
    handle = node.transport.post(op, peer, local, remote, b"")
    state = wait_done(node.transport, handle, timeout_s=5 * IO_TIMEOUT_S)
    assert state is not TransferState.PROC, f"{op.value} hung instead of failing"
    node.transport.release(handle)
    return state


def test_same_secret_reads_and_writes(nodes: list[Node]) -> None:
    """Baseline for every attack below: two peers holding the cluster secret move KV as usual
    (the handshake must not break legitimate READ/WRITE/notifications)."""
    a, b = _node(nodes, "a", SECRET, 1), _node(nodes, "b", SECRET, 2)
    _knows(a, b), _knows(b, a)
    handle = a.transport.post(Op.READ, "b", [0, 1], IDS[:2], b"read-done")
    assert wait_done(a.transport, handle) is TransferState.DONE
    np.testing.assert_array_equal(a.buffer[[0, 1]], pattern(2)[IDS[:2]])
    a.transport.release(handle)
    handle = a.transport.post(Op.WRITE, "b", [5, 6], IDS[2:], b"write-done")
    assert wait_done(a.transport, handle) is TransferState.DONE
    np.testing.assert_array_equal(b.buffer[IDS[2:]], pattern(1)[[5, 6]])
    a.transport.release(handle)
    deadline = time.monotonic() + 5.0
    notifs: list[tuple[str, bytes]] = []
    while len(notifs) < 2 and time.monotonic() < deadline:
        notifs += b.transport.get_notifs()
        time.sleep(0.001)
    assert sorted(notifs) == [("a", b"read-done"), ("a", b"write-done")]


def test_raw_socket_read_gets_no_kv(nodes: list[Node]) -> None:
    """Attack: read another client's KV. A raw socket without the secret sends a READ frame
    straight to the listener; it must get hung up on with none of the victim's block bytes."""
    victim = _node(nodes, "victim", SECRET, 7)
    with socket.create_connection(victim.addr, timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(encode_request(OP_READ, "attacker", IDS, b""))
        received, closed = _read_until_closed(sock, 4 * IO_TIMEOUT_S)
    assert closed, "the server kept an unauthenticated connection open"
    assert not _leaks(received, victim.buffer, IDS), "victim KV bytes reached the attacker"
    assert len(received) < BLOCK_NBYTES


def test_raw_socket_write_cannot_poison_prefix_cache(nodes: list[Node]) -> None:
    """Attack: poison the prefix cache. A raw socket without the secret sends a WRITE frame
    with forged block bytes and a notification; the victim's buffer must stay unchanged and
    the notification must never be delivered."""
    victim = _node(nodes, "victim", SECRET, 7)
    poison = np.full((len(IDS), BLOCK_NBYTES), 0xAB, dtype=np.uint8)
    with socket.create_connection(victim.addr, timeout=IO_TIMEOUT_S) as sock:
        try:
            sock.sendall(encode_request(OP_WRITE, "attacker", IDS, b"poison") + poison.tobytes())
        except OSError:  # refused mid-send: fine, that is the point
            pass
        _, closed = _read_until_closed(sock, 4 * IO_TIMEOUT_S)
    assert closed, "the server kept an unauthenticated connection open"
    np.testing.assert_array_equal(victim.buffer, pattern(7), "attacker bytes landed in the KV")
    assert victim.transport.get_notifs() == []


@pytest.mark.parametrize(
    ("victim_secret", "attacker_secret"),
    [(SECRET, "wrong-secret"), (SECRET, None), (None, SECRET)],
    ids=["wrong-secret", "client-without-secret", "server-without-secret"],
)
def test_wrong_secret_transfers_fail(
    nodes: list[Node],
    victim_secret: str | None,
    attacker_secret: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Attack: a peer configured with the wrong secret (or one side with none) tries READ and
    WRITE through the transport API. Both must end ERR, not hang, with 'authentication failed',
    and neither buffer may change: no KV read out, no prefix cache poisoned."""
    victim = _node(nodes, "victim", victim_secret, 7)
    attacker = _node(nodes, "attacker", attacker_secret, 9)
    _knows(attacker, victim)
    with caplog.at_level(logging.WARNING):
        assert _settle(attacker, Op.READ, "victim", [0, 1, 2, 3], IDS) is TransferState.ERR
        assert _settle(attacker, Op.WRITE, "victim", [0, 1, 2, 3], IDS) is TransferState.ERR
        np.testing.assert_array_equal(attacker.buffer, pattern(9), "victim KV landed at attacker")
        np.testing.assert_array_equal(victim.buffer, pattern(7), "attacker bytes landed in KV")
        assert "authentication failed" in caplog.text  # the attacker's job error
        if victim_secret:  # the victim refused a connection, naming its address
            wait_until(  # logged on its serving thread: may come later
                lambda: "refused KV connection from 127.0.0.1:" in caplog.text,
                "the victim logs its refusal",
                5.0,
            )


def _capture_proof(nodes: list[Node], name: str) -> tuple[bytes, bytes]:
    """A fake listener that asks `name` (holding SECRET) for a proof -> (its nonce, what the
    client sent in answer)."""
    client = _node(nodes, name, SECRET, 5)
    real = json.loads(client.transport.metadata()[4:])
    with socket.create_server(("127.0.0.1", 0)) as fake:
        body = {**real, "name": "fake", "port": fake.getsockname()[1]}
        client.transport.add_peer(b"DKVT" + json.dumps(body).encode())
        handle = client.transport.post(Op.WRITE, "fake", [0], [0], b"")
        fake.settimeout(5.0)
        conn, _ = fake.accept()
        with conn:
            nonce = bytes(range(32))
            conn.sendall(HELLO.pack(b"DKVA", 1, nonce))
            sent = _read_until_closed(conn, 5.0)[0]  # the client hangs up awaiting our answer
    assert wait_done(client.transport, handle, timeout_s=5.0) is TransferState.ERR
    return nonce, sent


def test_secret_never_on_the_wire_and_proof_cannot_be_replayed(nodes: list[Node]) -> None:
    """Attacks: an eavesdropper learning the secret from the handshake, and replaying a
    captured proof to the real victim. The client's bytes must not contain the secret, and the
    victim (which picks a fresh nonce) must refuse the replayed proof and serve nothing."""
    nonce, proof = _capture_proof(nodes, "a")
    assert len(proof) == PROOF.size + len(b"a") + 32
    assert SECRET.encode() not in proof and nonce not in proof
    victim = _node(nodes, "victim", SECRET, 7)
    with socket.create_connection(victim.addr, timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(proof + encode_request(OP_READ, "a", IDS, b""))
        received, closed = _read_until_closed(sock, 4 * IO_TIMEOUT_S)
    assert closed, "the victim kept a connection with a replayed proof open"
    assert not _leaks(received, victim.buffer, IDS), "victim KV bytes reached the replayer"


def test_silent_client_does_not_block_others(nodes: list[Node]) -> None:
    """Attack: denial of service by connecting and saying nothing. Silent connections must not
    delay other clients' handshakes, and the server must drop each one after io_timeout_s."""
    victim = _node(nodes, "victim", SECRET, 7)
    client = _node(nodes, "client", SECRET, 8)
    _knows(client, victim)
    silent = [socket.create_connection(victim.addr, timeout=IO_TIMEOUT_S) for _ in range(4)]
    try:
        start = time.monotonic()
        handle = client.transport.post(Op.READ, "victim", [0], [IDS[0]], b"")
        assert wait_done(client.transport, handle, timeout_s=5.0) is TransferState.DONE
        assert time.monotonic() - start < IO_TIMEOUT_S / 2, "served only after the silent ones"
        np.testing.assert_array_equal(client.buffer[0], pattern(7)[IDS[0]])
        client.transport.release(handle)
        for sock in silent:
            received, closed = _read_until_closed(sock, 4 * IO_TIMEOUT_S)
            assert closed, "a silent client held a server thread past io_timeout_s"
            assert len(received) == HELLO.size
    finally:
        for sock in silent:
            sock.close()
