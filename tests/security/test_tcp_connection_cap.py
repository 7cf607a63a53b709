"""The TCP KV transport serves at most `max_num_connections` connections at once.

Regression: every accepted connection got its own serving thread with no cap, so a flood of
connections (silent ones included, each held through the handshake timeout) could start threads
without bound. Past the cap a connection is closed at once, logged and counted; once connections
end, new ones (and real transfers) are served again.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator

import pytest

from disagg.kv.transport import Op, TransferState
from disagg.kv.transport.tcp import TcpTransport
from disagg.kv.transport.tcp_auth import HELLO
from tests.helpers import wait_until
from tests.kv.transport_peer import BLOCK_NBYTES, NUM_BLOCKS, make_buffer, wait_done

SECRET = "cluster-secret-for-cap-tests"
CAP = 4
IO_TIMEOUT_S = 5.0  # longer than the test needs: held connections stay in their handshake


@pytest.fixture
def transports() -> Iterator[list[TcpTransport]]:
    made: list[TcpTransport] = []
    yield made
    for transport in made:
        transport.close()


def _transport(made: list[TcpTransport], name: str, **kwargs: object) -> TcpTransport:
    transport = TcpTransport(name, io_timeout_s=IO_TIMEOUT_S, secret=SECRET, **kwargs)  # type: ignore[arg-type]
    transport.start()
    buffer = make_buffer()
    transport.register(buffer.ctypes.data, NUM_BLOCKS, BLOCK_NBYTES)
    transport._test_buffer = buffer  # type: ignore[attr-defined]  # kept alive with it
    made.append(transport)
    return transport


def _addr(transport: TcpTransport) -> tuple[str, int]:
    body = json.loads(transport.metadata()[4:])
    return body["host"], body["port"]


def _hello(sock: socket.socket) -> bytes:
    """The server's first frame, or b"" if it hung up instead."""
    sock.settimeout(5.0)
    try:
        return sock.recv(HELLO.size, socket.MSG_WAITALL)
    except ConnectionResetError:
        return b""


def test_connections_past_the_cap_are_refused_logged_and_counted(
    transports: list[TcpTransport], caplog: pytest.LogCaptureFixture
) -> None:
    server = _transport(transports, "server", max_num_connections=CAP)
    held = [socket.create_connection(_addr(server)) for _ in range(CAP)]
    try:
        for sock in held:  # (1) up to the cap: each is served (its handshake starts)
            assert len(_hello(sock)) == HELLO.size
        with caplog.at_level(logging.WARNING):  # (2) one more: hung up on, no thread
            with socket.create_connection(_addr(server)) as extra:
                assert _hello(extra) == b""
            assert server.num_refused_connections == 1
            assert "refused a KV connection" in caplog.text and f"{CAP} open" in caplog.text
    finally:
        for sock in held:
            sock.close()
    # (3) the held ones end: there is room again
    wait_until(lambda: server.num_open_connections == 0, "the server closes every connection")
    with socket.create_connection(_addr(server)) as again:
        assert len(_hello(again)) == HELLO.size


def test_a_peer_transfers_once_the_flood_ends(transports: list[TcpTransport]) -> None:
    server = _transport(transports, "server", max_num_connections=CAP)
    client = _transport(transports, "client")
    client.add_peer(server.metadata())
    flood = [socket.create_connection(_addr(server)) for _ in range(3 * CAP)]
    for sock in flood:
        sock.close()
    wait_until(lambda: server.num_open_connections == 0, "the server closes every connection")
    handle = client.post(Op.READ, "server", [0, 1], [2, 3], b"")
    assert wait_done(client, handle) is TransferState.DONE


def test_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_num_connections"):
        TcpTransport("bad", max_num_connections=0)
