"""An instance's membership in a router (`disagg serve --router URL`): register, heartbeat,
drain, leave.

Every `heartbeat_s` the instance posts a signed registration (its URL and role) to the router,
which adds it on the first one and drops it when they stop. Each call is signed afresh (the
router accepts a signature once) and the router's answer must be signed for it. On SIGTERM it
says it is draining (the router sends it no new work), waits until every request it holds has
finished and every KV block a peer may still read is released, deregisters, and only then
stops. Must not serve requests (app.py) or touch the engine beyond asking whether it is idle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from disagg.protocol import DEREGISTER_PATH, REGISTER_PATH
from disagg.security import auth

__all__ = ["Registration"]

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 5.0
_IDLE_POLL_S = 0.05


class Registration:
    def __init__(
        self,
        router_url: str,
        own_url: str,
        role: str,
        cluster_token: str,
        heartbeat_s: float,
        *,
        ssl_context: ssl.SSLContext | None = None,  # an https router's CA (internal TLS)
    ) -> None:
        self.router_url = router_url.rstrip("/")
        self.ssl_context = ssl_context
        self.own_url = own_url
        self.role = role
        self.cluster_token = cluster_token
        self.heartbeat_s = heartbeat_s
        self.is_draining = False
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._is_failing = False  # log a failed heartbeat once per streak, not every beat

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self.ssl_context or True)
        timeout = aiohttp.ClientTimeout(total=_CALL_TIMEOUT_S)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._task = asyncio.create_task(self._beat_forever(), name="router-heartbeat")

    async def drain(self, is_idle: Callable[[], bool], timeout_s: float) -> bool:
        """Tell the router to send nothing new; wait until `is_idle()`. False on timeout."""
        self.is_draining = True
        await self._beat()  # now, not at the next interval
        log.info("draining: waiting for in-flight requests and held KV (up to %gs)", timeout_s)
        deadline = time.monotonic() + timeout_s
        while not is_idle():
            if time.monotonic() > deadline:
                log.warning("drain timed out after %gs with work left", timeout_s)
                return False
            await asyncio.sleep(_IDLE_POLL_S)
        return True

    async def leave(self) -> None:
        """Stop heartbeating and deregister (best effort: the router also expires us)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self._post(DEREGISTER_PATH, {"url": self.own_url})
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("deregistering from %s failed: %r", self.router_url, exc)
        if self._session is not None:
            await self._session.close()

    async def _beat_forever(self) -> None:
        while True:
            try:
                await self._beat()
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not self._is_failing:  # the router may not be up yet; keep trying
                    log.warning("heartbeat to %s failed: %r", self.router_url, exc)
                self._is_failing = True
            await asyncio.sleep(self.heartbeat_s)

    async def _beat(self) -> None:
        body = {"url": self.own_url, "role": self.role, "draining": self.is_draining}
        await self._post(REGISTER_PATH, body)
        if self._is_failing:
            log.info("registered with %s again", self.router_url)
        self._is_failing = False

    async def _post(self, path: str, body: dict[str, Any]) -> None:
        """One signed call (a fresh nonce: the router accepts each once); the router's answer
        must be signed for it, or the call counts as failed."""
        assert self._session is not None, "start() first"
        url, data = self.router_url + path, json.dumps(body).encode()
        signature = auth.sign(self.cluster_token, "POST", url, data)
        headers = {"Content-Type": "application/json", auth.SIGNATURE_HEADER: signature.header}
        async with self._session.post(url, data=data, headers=headers) as resp:
            raw = await resp.read()
            if resp.status >= 400:  # a refusal (wrong role, bad token) will not heal by itself
                raise _failed(resp, raw[:300].decode(errors="replace"))
            try:
                auth.check_answer(self.cluster_token, resp.headers.get(auth.SIGNATURE_HEADER),
                                  signature.nonce, resp.status, raw)  # fmt: skip
            except auth.SignatureError as exc:
                raise _failed(resp, f"{url}: {exc}") from exc


def _failed(resp: aiohttp.ClientResponse, message: str) -> aiohttp.ClientResponseError:
    return aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=message)
