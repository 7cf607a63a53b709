"""KV transports behind one contract (base.Transport): nixl, tcp, and the in-process local one.

Owns the factory and the choice `auto` (NIXL when installed, else TCP). NIXL is imported
lazily, so hosts without it can still use tcp and local.
"""

from __future__ import annotations

import functools
import logging

from disagg.kv.transport.base import Op, PeerInfo, TransferState, Transport, TransportError

__all__ = [
    "Op",
    "PeerInfo",
    "TransferState",
    "Transport",
    "TransportError",
    "make_transport",
    "resolve_kind",
]

logger = logging.getLogger(__name__)

NIXL_MISSING = (
    "the nixl KV transport needs NIXL, which is not installed: "
    "pip install 'disagg[nixl]', or use --kv-transport tcp"
)


@functools.cache
def _has_nixl() -> bool:
    from disagg.kv.transport.nixl import nixl_api

    try:
        nixl_api()
    except TransportError:
        return False
    return True


def resolve_kind(kind: str) -> str:
    """The transport `kind` names: `auto` becomes nixl or tcp (logged). Raises TransportError
    with the fix when nixl is asked for and not installed."""
    if kind == "auto":
        kind = "nixl" if _has_nixl() else "tcp"
        _log_choice(kind)
    elif kind == "nixl" and not _has_nixl():
        raise TransportError(NIXL_MISSING)
    return kind


@functools.cache
def _log_choice(kind: str) -> None:
    why = "NIXL is installed" if kind == "nixl" else "no NIXL here: pip install 'disagg[nixl]'"
    logger.info("KV transport: %s (auto; %s)", kind, why)


def make_transport(
    kind: str,
    name: str,
    *,
    host: str = "127.0.0.1",
    device: str = "cpu",
    secret: str | None = None,
) -> Transport:
    """A fresh, unregistered, started transport named `name` (unique per process: engine id).

    kind: "auto" | "nixl" | "tcp" | "local" (see resolve_kind). `host` is the address peers
    reach us on (tcp listener; for nixl a loopback host keeps UCX on loopback); local ignores
    it. `device` is where the registered KV buffer lives ("cpu" | "cuda[:N]"); only nixl
    moves device memory.
    `secret` is the cluster's shared secret: tcp serves and sends only to peers proving the
    same one (None: no proof, and peers must have none either); nixl and local ignore it.
    """
    kind = resolve_kind(kind)
    if kind == "nixl":
        from disagg.kv.transport.nixl import NixlTransport

        return NixlTransport(name, host=host, device=device)
    if kind in ("tcp", "local") and device != "cpu":
        raise ValueError(f"the {kind} transport moves host memory only, got device {device!r}")
    if kind == "tcp":
        from disagg.kv.transport.tcp import TcpTransport

        tcp = TcpTransport(name, host=host, secret=secret)
        tcp.start()  # its listener thread: peers may connect as soon as they have our metadata
        return tcp
    if kind == "local":
        from disagg.kv.transport.local import LocalTransport

        return LocalTransport(name)
    raise ValueError(f"transport kind must be auto, nixl, tcp or local, got {kind!r}")
