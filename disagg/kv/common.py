"""What pull and push share: the transport over the KV tensor, the HTTP side channel
(handshake with a compatibility check), peer bookkeeping, the notification listener thread,
thread-safe reporting to the engine loop, and transfer statistics.

Subclasses implement the KVConnector hooks; nothing here decides when bytes move. Lifecycle:
construct (no thread runs yet) -> start() (the listener; subclasses add their own) -> close().
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from disagg.config import EngineConfig
from disagg.engine.kv_connector import KVConnectorWorker
from disagg.engine.outputs import KVConnectorOutput, KVFailure
from disagg.kv.faults import KVFaults
from disagg.kv.handshake import KV_LAYOUT, Compat, decode_message
from disagg.kv.transport import TransportError, make_transport, resolve_kind
from disagg.security import auth
from disagg.security.tls import client_context, scheme

__all__ = [
    "ConnectorBase",
    "HandshakeError",
    "KVIdentity",
    "SideChannelError",
    "SideHandler",
    "post_json",
]

log = logging.getLogger(__name__)

# Notification polling backs off from the fast period to the slow one while nothing arrives,
# and snaps back on every message. Polling at 0.5 ms for the whole of a long prefill (a push
# reservation waits that long) took CPU from the prefill on two cores; 2 ms adds at most that
# much to a push handoff's notification latency.
_LISTEN_FAST_S = 0.00025
_LISTEN_SLOW_S = 0.002
_IDLE_LISTEN_INTERVAL_S = 0.01  # nothing pending at all: no notification is awaited
_NUM_CALL_THREADS = 8


SideHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(slots=True)
class KVIdentity:
    """Who this instance is on the KV side channel; both connector halves read it."""

    engine_id: str
    host: str
    port: int | None = None  # set once the server listens


class HandshakeError(RuntimeError):
    """The peer refused us (incompatible) or could not be reached."""


def post_json(
    url: str,
    body: dict[str, Any],
    timeout_s: float = 10.0,
    *,
    secret: str = "",
    context: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    """Blocking JSON POST for background threads, signed with the cluster secret for `url`
    (the peer accepts it there, once); the answer must be signed by the peer for this very
    call. `context` verifies an https peer (internal TLS). Raises HandshakeError with the
    peer's reason."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    signature = auth.sign(secret, "POST", url, data) if secret else None
    if signature is not None:
        headers[auth.SIGNATURE_HEADER] = signature.header
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as resp:
            raw, status = resp.read(), resp.status
            answer_signature = resp.headers.get(auth.SIGNATURE_HEADER)
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = f"HTTP {exc.code}"
        raise HandshakeError(reason) from exc
    except (OSError, ValueError) as exc:
        raise HandshakeError(f"{url} unreachable: {exc}") from exc
    if signature is not None:
        try:
            auth.check_answer(secret, answer_signature, signature.nonce, status, raw)
        except auth.SignatureError as exc:
            raise HandshakeError(f"{url} answered without the cluster's signature: {exc}") from exc
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise HandshakeError(f"{url} sent no JSON: {exc}") from exc


def _model_fingerprint(runner: Any) -> str:
    spec = runner.spec
    return (
        f"{spec.architecture}:L{spec.num_layers}:H{spec.num_kv_heads}x{spec.head_dim}"
        f":V{spec.vocab_size}:D{spec.hidden_size}"
    )


class ConnectorBase(KVConnectorWorker):
    def __init__(
        self, config: EngineConfig, runner: Any, *, wake: Any = None, faults: KVFaults | None = None
    ) -> None:
        kv = config.kv_transfer
        self.config = config
        self.kv_config = kv
        self.role = kv.role
        self.block_size = config.cache.block_size
        self.identity = KVIdentity(kv.engine_id or f"{kv.role}-{uuid.uuid4().hex[:12]}", kv.host)
        self._wake = wake or (lambda: None)
        self.faults = faults or KVFaults()  # a test hook (kv/faults.py): none in production
        self.secret = kv.cluster_token  # signs the side channel; authenticates tcp peers
        self.side_tls = client_context(kv.tls_ca_file)  # None: peers' side channels are http
        self.transport_kind = resolve_kind(kv.transport)  # "auto" becomes what this host has
        self.transport = make_transport(
            self.transport_kind,
            self.engine_id,
            host=kv.host,
            device=config.device,
            secret=self.secret,
        )
        self.transport.register(runner.kv_base_addr, runner.num_blocks, runner.block_nbytes)
        self.block_nbytes = runner.block_nbytes
        self.vocab_size = runner.spec.vocab_size
        self.compat = Compat(
            model=_model_fingerprint(runner),
            dtype=runner.dtype_name,  # resolved: "auto" may mean bf16 here and fp32 there
            block_size=self.block_size,
            block_nbytes=runner.block_nbytes,
            layout=KV_LAYOUT,
            connector=kv.connector,
            transport=self.transport_kind,
        )
        self._lock = threading.Lock()
        self._report = KVConnectorOutput()  # filled by any thread, swapped out by the loop
        self._peers: dict[str, Future[str]] = {}  # engine id -> transport peer name (handshake)
        self._handshakes = ThreadPoolExecutor(2, thread_name_prefix="kv-handshake")
        self._control = ThreadPoolExecutor(1, thread_name_prefix="kv-control")  # notifications
        # Side-channel calls (push registrations and cancels, pull releases): several at once,
        # so one slow peer or one slow call never holds up the others.
        self.calls = ThreadPoolExecutor(_NUM_CALL_THREADS, thread_name_prefix="kv-call")
        self.stats: dict[str, float] = dict.fromkeys(_STAT_NAMES, 0)
        self._stopping = threading.Event()
        self._listener: threading.Thread | None = None  # started by start()

    def start(self) -> None:
        """Start the listener; the builder calls it once all subclass state exists."""
        self._listener = threading.Thread(target=self._listen, name="kv-listener", daemon=True)
        self._listener.start()

    # ------------------------------------------------------------------ identity

    @property
    def engine_id(self) -> str:
        return self.identity.engine_id

    def side_url(self, host: str, port: int) -> str:
        """A peer's side channel: its HTTP port, over TLS when the cluster runs it."""
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return f"{scheme(self.side_tls is not None)}://{netloc}"

    def set_address(self, host: str, port: int) -> None:
        self.identity.port = port

    def info(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "connector": self.kv_config.connector,
            "transport": self.transport_kind,
            "kv_host": self.identity.host,
            "kv_port": self.identity.port,
            "block_size": self.block_size,
            "model": self.config.model_name,
            "compat": self.compat.to_dict(),
            "stats": {**self.stats, "connections_refused": self.transport.num_refused_connections},
        }

    def side_channel(self) -> dict[str, SideHandler]:
        """POST path -> handler of this instance's KV side channel. The server mounts them
        (server/kv_routes.py) behind its cluster-signature check; handlers take the JSON
        body and return the JSON answer, or raise SideChannelError."""
        return {"/kv/handshake": self._handle_handshake}

    # ------------------------------------------------------------------ handshake

    async def _handle_handshake(self, body: dict[str, Any]) -> dict[str, Any]:
        """A peer introduces itself: check compatibility, learn its transport metadata."""
        try:
            theirs = Compat.from_dict(body["compat"])
            metadata = base64.b64decode(body["metadata"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SideChannelError(400, f"bad handshake: {exc}") from exc
        reason = self.compat.mismatch(theirs, mine=self.role, theirs=str(body.get("role", "peer")))
        if reason is not None:
            self.stats["handshakes_refused"] += 1
            log.warning("refused handshake from %s: %s", body.get("engine_id"), reason)
            raise SideChannelError(409, reason)
        try:
            await asyncio.to_thread(self.transport.add_peer, metadata)
        except TransportError as exc:
            raise SideChannelError(502, f"cannot reach the peer's transport: {exc}") from exc
        return self._hello()

    def _hello(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "compat": self.compat.to_dict(),
            "metadata": base64.b64encode(self.transport.metadata()).decode(),
        }

    def ensure_peer(self, engine_id: str, host: str, port: int) -> Future[str]:
        """The transport peer name of `engine_id`, handshaking in the background on first
        contact. A peer that restarted has a new engine id, so it is met afresh."""
        with self._lock:
            future = self._peers.get(engine_id)
            if future is None or (future.done() and future.exception() is not None):
                future = self._handshakes.submit(self._handshake, engine_id, host, port)
                self._peers[engine_id] = future
            return future

    def _handshake(self, engine_id: str, host: str, port: int) -> str:
        started = time.monotonic()
        url = f"{self.side_url(host, port)}/kv/handshake"
        answer = post_json(url, self._hello(), secret=self.secret, context=self.side_tls)
        if answer.get("engine_id") != engine_id:
            raise HandshakeError(
                f"{host}:{port} is engine {answer.get('engine_id')!r}, not {engine_id!r} "
                "(it restarted?)"
            )
        reason = self.compat.mismatch(
            Compat.from_dict(answer["compat"]), mine=self.role, theirs=str(answer.get("role"))
        )
        if reason is not None:
            raise HandshakeError(reason)
        try:
            name = self.transport.add_peer(base64.b64decode(answer["metadata"])).name
        except TransportError as exc:
            raise HandshakeError(f"cannot reach {engine_id}'s transport: {exc}") from exc
        self.stats["handshakes"] += 1
        self.stats["handshake_s_total"] += time.monotonic() - started
        return name

    # ------------------------------------------------------------------ reporting

    def report(
        self,
        *,
        sent: str | None = None,
        received: str | None = None,
        failed: tuple[str, KVFailure] | None = None,
        settled: str | None = None,
        first_token: tuple[str, int] | None = None,
        breakdown: tuple[str, dict[str, float]] | None = None,
    ) -> None:
        """Thread-safe: queue a result for the next get_finished() on the engine loop."""
        with self._lock:
            if breakdown is not None:
                self._report.stages.setdefault(breakdown[0], {}).update(breakdown[1])
            if sent is not None:
                self._report.finished_sending.add(sent)
            if received is not None:
                self._report.finished_recving.add(received)
            if failed is not None:
                self._report.failed[failed[0]] = failed[1]
            if settled is not None:
                self._report.settled.add(settled)
            if first_token is not None:
                self._report.first_token_ids[first_token[0]] = first_token[1]
        self._wake()

    def take_reports(self) -> KVConnectorOutput:
        with self._lock:
            out, self._report = self._report, KVConnectorOutput()
        return out

    def notify_quietly(self, peer: str, message: bytes) -> None:
        """Best-effort notification (control thread): a peer that is gone has a deadline or a
        lease that covers whatever this message would have settled."""
        try:
            self.transport.send_notif(peer, message)
        except TransportError:
            log.info("notification to %s not delivered (peer gone)", peer)

    def failure(self, reason: str) -> KVFailure:
        """A failed handoff under this deployment's policy (`recompute`: prefill locally)."""
        self.stats["transfers_failed"] += 1
        return KVFailure(reason, recompute=self.kv_config.failure_policy == "recompute")

    def first_token_or_none(self, value: object) -> int | None:
        """A first token id from a peer's message, if it is one this model has."""
        if type(value) is int and 0 <= value < self.vocab_size:
            return value
        if value is not None:
            log.warning("ignoring first_token_id %r from a peer (vocabulary %d)", value,
                        self.vocab_size)  # fmt: skip
        return None

    def count_transfer(self, num_blocks: int, num_descriptors: int, seconds: float) -> None:
        self.stats["transfers"] += 1
        self.stats["blocks"] += num_blocks
        self.stats["bytes"] += num_blocks * self.block_nbytes
        self.stats["descriptors"] += num_descriptors
        self.stats["transfer_s_total"] += seconds

    # ------------------------------------------------------------------ listener thread

    def _listen(self) -> None:
        interval = _LISTEN_FAST_S
        while not self._stopping.is_set():
            try:
                notifs = self.transport.get_notifs()
            except TransportError:
                return  # closed
            for peer, raw in notifs:
                message = decode_message(raw)
                if message is None:
                    continue
                try:
                    self.on_message(peer, message)
                except (ValueError, TypeError, KeyError) as exc:  # a malformed field
                    log.warning("dropped a malformed %r message from %s: %r",
                                message.get("kind"), peer, exc)  # fmt: skip
            interval = _LISTEN_FAST_S if notifs else min(interval * 2, self.listen_cap_s())
            self._stopping.wait(interval if self.has_pending() else _IDLE_LISTEN_INTERVAL_S)

    def on_message(self, peer: str, message: dict[str, Any]) -> None:
        """A notification from a peer (listener thread)."""

    def listen_cap_s(self) -> float:
        """The slowest notification poll while something is pending."""
        return _LISTEN_SLOW_S

    def close(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
        self._control.shutdown(wait=False, cancel_futures=True)
        self.calls.shutdown(wait=False, cancel_futures=True)
        self._handshakes.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


_STAT_NAMES = (
    "handshakes", "handshakes_refused", "handshake_s_total", "transfers", "transfers_failed",
    "blocks", "bytes", "descriptors", "transfer_s_total", "post_s_total", "expired_leases",
    "expired_reservations", "registrations_before_ready", "registrations_after_ready",
    "registrations_refused",
)  # fmt: skip


class SideChannelError(Exception):
    """A side-channel call refused: HTTP status and the reason the caller reads."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
