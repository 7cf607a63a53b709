"""TLS for internal HTTP: the contexts a process serves HTTPS with (`--internal-tls-cert` and
`--internal-tls-key`) and verifies its peers with (`--internal-tls-ca`), from PEM files.

Signatures (disagg.security.auth) prove who sent a call; TLS keeps what it carries secret: KV
transport metadata in a handshake is what NIXL needs to read and write an instance's KV, so on
a network others can read it must not travel in clear. Stdlib only; no torch, no HTTP library.
"""

from __future__ import annotations

import ssl

__all__ = ["client_context", "scheme", "server_context"]


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """The context to listen with, or None (plain HTTP) when no certificate is configured."""
    if not cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def client_context(ca_file: str) -> ssl.SSLContext | None:
    """The context to call peers with: their certificates must chain to `ca_file` and name
    the host called (an IP address or DNS name in the subjectAltName). None: the system's
    defaults (and plain HTTP to peers)."""
    if not ca_file:
        return None
    return ssl.create_default_context(cafile=ca_file)


def scheme(is_tls: bool) -> str:
    return "https" if is_tls else "http"
