"""The receiving end of cluster calls in one process (an instance or the router): is a request
signed with the cluster token, for this process, and the first of its kind? And the signature
of its answer, bound to that call. disagg.security.auth owns the wire format; this module owns what
"this process" means. Must not decide what a verified caller may do (server/security.py and
router/membership.py do) nor read bodies for meaning.

A call is signed for the `host:port` its caller sent it to. This process takes it as its own
when
  1. it is the authority of a URL this process advertises (`--advertise-url`): behind NAT, a
     port mapping or a Kubernetes Service the caller's name for us is not one we can work
     out, so it must be named; or
  2. the port is the one the call arrived on, and the host is one of this process's names:
     its `--host` / `--kv-host`, the address the call arrived at, `localhost` when it arrived
     over loopback, or a name that resolves (DNS, cached for a minute) to that address. A
     loopback name (localhost, 127.x, ::1) counts only for a call that arrived over loopback:
     every host has one.
So a call signed for instance A is refused by instance B: on one host they differ by port,
across hosts by address; `http://localhost:P` and `http://127.0.0.1:P` both reach (and are)
the instance on 127.0.0.1:P, and a router that lists an instance by its DNS name reaches the
address the instance sees. Only a call whose MAC already verified is resolved, so only token
holders choose what is looked up.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from dataclasses import dataclass

from aiohttp import web

from disagg.security import auth

__all__ = ["CallGuard", "Identity"]

_DNS_TTL_S = 60.0
_MAX_NUM_NAMES = 256  # resolved names kept; only names in verified signatures get here
_WILDCARDS = ("", "0.0.0.0", "::")
LocalAddress = tuple[str, int]  # (ip, port) the connection arrived at


@dataclass(frozen=True, slots=True)
class Identity:
    """The names this process answers to, besides the address each call arrives at."""

    advertised: tuple[str, ...] = ()  # exact `host:port` authorities (--advertise-url)
    hosts: tuple[str, ...] = ()  # host names at whichever port a call arrives on (--host)

    @classmethod
    def of(cls, advertise_urls: tuple[str, ...], hosts: tuple[str, ...]) -> Identity:
        """From URLs and listen/KV hosts as configured ("" and wildcards dropped)."""
        advertised = tuple(auth.authority_of(url) for url in advertise_urls if url)
        return cls(advertised, tuple(h.lower() for h in hosts if h not in _WILDCARDS))


class CallGuard:
    """Checks cluster calls arriving at one process and signs their answers."""

    def __init__(self, secret: str, identity: Identity | None = None) -> None:
        assert secret, "a CallGuard needs the cluster token"
        self.secret = secret
        self.identity = identity or Identity()
        self._nonces = auth.NonceCache()
        self._resolved: dict[str, tuple[float, frozenset[str]]] = {}  # name -> (until, ips)

    async def check(self, request: web.Request) -> auth.Signature:
        """The request's signature if it is a valid, first-seen call for this process; raises
        auth.SignatureError saying why not (the caller answers 401)."""
        body = await request.read()  # aiohttp keeps it: the handler reads it again for free
        now = time.time()
        signature = auth.check(
            self.secret,
            request.headers.get(auth.SIGNATURE_HEADER),
            request.method,
            request.raw_path,
            body,
            request_id=request.headers.get(auth.REQUEST_ID_HEADER, ""),
            now=now,
        )
        local = _local_address(request)
        if not await self._is_mine(signature.authority, local):
            where = f"{local[0]}:{local[1]}" if local else "an unknown address"
            raise auth.SignatureError(
                f"call signed for {signature.authority}, which is not this process (it was "
                f"reached at {where}; name other addresses with --advertise-url)"
            )
        self._nonces.admit(signature, now)
        return signature

    def sign_answer(
        self, signature: auth.Signature, response: web.StreamResponse
    ) -> web.StreamResponse:
        """Sign a buffered answer to the call `signature` (a stream is sent unsigned)."""
        if isinstance(response, web.Response) and isinstance(response.body, bytes):
            value = auth.sign_answer(self.secret, signature.nonce, response.status, response.body)
            response.headers[auth.SIGNATURE_HEADER] = value
        return response

    async def _is_mine(self, authority: str, local: LocalAddress | None) -> bool:
        if authority in self.identity.advertised:
            return True
        host, port = auth.split_authority(authority)
        if local is None or port != local[1]:
            return False
        is_named = host in self.identity.hosts or _same_ip(host, local[0])
        if _is_loopback(host):
            # Every host has a 127.0.0.1: a loopback name is ours only over loopback, or a
            # call made to a peer's own loopback could be replayed to us over the network.
            return _is_loopback(local[0]) and (is_named or host == "localhost")
        return is_named or local[0] in await self._addresses(host)

    async def _addresses(self, host: str) -> frozenset[str]:
        """What `host` resolves to (normalised IPs), cached; empty when it does not."""
        now = time.monotonic()
        cached = self._resolved.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return frozenset()  # not cached: a name that fails now may resolve in a moment
        if len(self._resolved) >= _MAX_NUM_NAMES:
            self._resolved.clear()
        addresses = frozenset(_normal_ip(str(info[4][0])) for info in infos)
        self._resolved[host] = (now + _DNS_TTL_S, addresses)
        return addresses


def _local_address(request: web.Request) -> LocalAddress | None:
    """The (ip, port) this connection was accepted at; None once it is gone."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None  # a Unix socket, or the client left
    return _normal_ip(str(sockname[0])), int(sockname[1])


def _normal_ip(text: str) -> str:
    """One spelling per address: IPv4-mapped IPv6 (a dual-stack listener) as IPv4."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost


def _same_ip(host: str, ip: str) -> bool:
    try:
        return _normal_ip(host) == ip
    except ValueError:
        return False  # a name, not an address
