"""KV transports behind one contract (base.Transport): nixl, tcp, and the in-process local one.

Owns the factory only. NIXL is imported lazily, so hosts without it can still use tcp and local.
"""

from __future__ import annotations

from disagg.kv.transport.base import Op, PeerInfo, TransferState, Transport, TransportError

__all__ = [
    "Op",
    "PeerInfo",
    "TransferState",
    "Transport",
    "TransportError",
    "make_transport",
]


def make_transport(
    kind: str,
    name: str,
    *,
    host: str = "127.0.0.1",
    device: str = "cpu",
    secret: str | None = None,
) -> Transport:
    """A fresh, unregistered transport named `name` (unique per process, e.g. the engine id).

    kind: "nixl" | "tcp" | "local". `host` is the address peers reach us on (tcp listener;
    for nixl a loopback host keeps UCX on loopback); local ignores it. `device` is where the
    registered KV buffer lives ("cpu" | "cuda[:N]"); only nixl moves device memory.
    `secret` is the cluster's shared secret: tcp serves and sends only to peers proving the
    same one (None: no proof, and peers must have none either); nixl and local ignore it.
    """
    if kind == "nixl":
        from disagg.kv.transport.nixl import NixlTransport

        return NixlTransport(name, host=host, device=device)
    if kind in ("tcp", "local") and device != "cpu":
        raise ValueError(f"the {kind} transport moves host memory only, got device {device!r}")
    if kind == "tcp":
        from disagg.kv.transport.tcp import TcpTransport

        return TcpTransport(name, host=host, secret=secret)
    if kind == "local":
        from disagg.kv.transport.local import LocalTransport

        return LocalTransport(name)
    raise ValueError(f"transport kind must be nixl, tcp or local, got {kind!r}")
