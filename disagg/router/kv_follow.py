"""Keeps the router's KV index (kv_index.py) current: every poll interval it asks each healthy
instance for what its prefix cache gained and lost since the last answer applied
(`GET /kv/events`, signed with the cluster token like every internal call, and the answer's
signature checked: the digests of cached prompts are not for anyone else to read or forge).
An instance that is not healthy, or has left the pool, is forgotten: it may come back empty.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlencode

import aiohttp

from disagg.config import RouterConfig
from disagg.protocol import KV_EVENTS_PATH
from disagg.router.instances import PROBE_TIMEOUT_S, Instance, InstancePool
from disagg.router.kv_index import KVIndex
from disagg.security import auth

__all__ = ["KVFollower"]

logger = logging.getLogger(__name__)


class KVFollower:
    def __init__(self, cfg: RouterConfig, pool: InstancePool, index: KVIndex) -> None:
        assert cfg.cluster_token, "/kv/events is an internal route: it needs the cluster token"
        self.cfg = cfg
        self.pool = pool
        self.index = index
        self._task: asyncio.Task[None] | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._follow_forever(session), name="router-kv-follow")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        healthy = [inst for inst in self.pool.instances if inst.is_healthy]
        for url in self.index.followed() - {inst.url for inst in healthy}:
            self.index.forget(url)
        await asyncio.gather(*(self._follow(session, inst) for inst in healthy))

    async def _follow_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.cfg.load_poll_interval_s)
            await self.refresh(session)

    async def _follow(self, session: aiohttp.ClientSession, inst: Instance) -> None:
        epoch, seq = self.index.cursor(inst.url)
        url = f"{inst.url}{KV_EVENTS_PATH}?{urlencode({'epoch': epoch, 'seq': seq})}"
        signature = auth.sign(self.cfg.cluster_token, "GET", url, b"")
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            async with session.get(
                url, headers={auth.SIGNATURE_HEADER: signature.header}, timeout=timeout
            ) as resp:
                raw = await resp.read()
                auth.check_answer(self.cfg.cluster_token, resp.headers.get(auth.SIGNATURE_HEADER),
                                  signature.nonce, resp.status, raw)  # fmt: skip
                resp.raise_for_status()
                self.index.apply(inst.url, await resp.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError, auth.SignatureError) as exc:
            logger.debug("instance %s: /kv/events failed: %r", inst.url, exc)
