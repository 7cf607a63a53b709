"""The instances behind the router (instance.py: one's record), and the task that keeps them fresh.

Owns each instance's health (`/health`), load (`/load`), identity (which kind it is and who it
is on the KV side: identify.py) and circuit breaker (fed each leg's outcome by legs.py), the
live membership (instances named on the command line, plus those that register themselves and
keep heartbeating), and turns a policy's choice into an `Instance`. Must not proxy requests
(legs.py) nor rank instances (policy.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import aiohttp

from disagg.config import RouterConfig
from disagg.router.breaker import CircuitBreaker
from disagg.router.identify import identify, mismatch_warning, refusal
from disagg.router.identity import Identity, VLLMIdentity, parse_side_channel
from disagg.router.instance import Instance, Source, normalize_url
from disagg.router.kv_index import KV_AWARE_INDEX_BLOCKS, KVIndex, with_cached_tokens
from disagg.router.policy import InstanceRole, Load, Policy, make_policy, uncached_at_pick
from disagg.router.vllm_load import load_from_vllm_metrics

__all__ = [
    "HEALTH_POLL_INTERVAL_S",
    "Instance",
    "InstancePool",
    "MembershipError",
    "normalize_url",
]

logger = logging.getLogger(__name__)

HEALTH_POLL_INTERVAL_S = 0.5  # how often /health is probed; load polling has its own interval
PROBE_TIMEOUT_S = 2.0  # one /health, /load or identity probe
LATE_BINDING_TIMEOUT_S = 0.5  # /load refresh on a request's path: stale beats a slow TTFT

PoolName = Literal["prefill", "decode"]


class MembershipError(ValueError):
    """A registration the router refuses (a role this mode does not use)."""


class InstancePool:
    """All instances of one router, in two pools: `prefill` (P legs), `decode` (D or aggregated)."""

    def __init__(self, cfg: RouterConfig, *, health_interval_s: float = HEALTH_POLL_INTERVAL_S):
        self.cfg = cfg
        self.decode_role: InstanceRole = "both" if cfg.mode == "aggregated" else "decode"
        self.health_interval_s = health_interval_s
        is_aggregated = cfg.mode == "aggregated"
        # In aggregated mode prefill URLs are unused: decode instances serve whole requests.
        prefill_urls = () if is_aggregated else cfg.prefill_urls
        self.prefill = [self._new(normalize_url(u), "prefill") for u in prefill_urls]
        self.decode = [self._new(normalize_url(u), self.decode_role) for u in cfg.decode_urls]
        # vLLM instances' KV identities as the operator declared them, by base URL.
        self.declared: dict[str, VLLMIdentity] = {
            normalize_url(url): found
            for url, found in map(parse_side_channel, cfg.vllm_side_channels)
        }
        tokens = cfg.kv_aware_request_tokens
        self._policies: dict[PoolName, Policy] = {
            "prefill": make_policy(cfg.policy, request_tokens=tokens),
            "decode": make_policy(cfg.policy, request_tokens=tokens),
        }
        size = cfg.kv_index_max_blocks or (KV_AWARE_INDEX_BLOCKS if cfg.policy == "kv_aware" else 0)
        self.kv_index = KVIndex(size) if size else None  # fed by kv_follow.py
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()  # first probes of new registrations

    @property
    def instances(self) -> list[Instance]:
        return [*self.prefill, *self.decode]

    @property
    def uses_load(self) -> bool:
        return self.cfg.policy in ("least_loaded", "kv_aware")

    def is_ready(self) -> bool:
        """At least one instance taking work in every pool this mode needs."""
        pools = [self.decode] if self.cfg.mode == "aggregated" else [self.prefill, self.decode]
        return all(any(inst.takes_work for inst in pool) for pool in pools)

    def has_healthy(self, pool: PoolName) -> bool:
        """Some instance of `pool` the policy may pick now."""
        now_s = time.monotonic()
        instances = self.prefill if pool == "prefill" else self.decode
        return any(inst.is_pickable(now_s) for inst in instances)

    def _new(self, url: str, role: InstanceRole, source: Source = "static") -> Instance:
        breaker = CircuitBreaker(self.cfg.breaker_failures, self.cfg.breaker_cooldown_s)
        return Instance(url=url, role=role, breaker=breaker, source=source)

    # ------------------------------------------------------------------ membership

    def register(self, url: str, role: str, *, is_draining: bool = False) -> Instance:
        """A heartbeat from `url`: add it (probed before it takes work) or refresh it. A
        static instance that registers keeps its place and never expires."""
        url = normalize_url(url)
        pool_name = self._pool_for(role)
        inst = self.find(url)
        if inst is not None and inst.role != role:
            raise MembershipError(f"{url} is already a {inst.role} instance, not {role}")
        if inst is None:
            inst = self._new(url, role, "registered")  # type: ignore[arg-type]
            (self.prefill if pool_name == "prefill" else self.decode).append(inst)
            logger.info("instance %s (%s) registered", url, role)
            if self._session is not None:  # probed now, not at the next poll
                probe = asyncio.get_running_loop().create_task(self._probe_health(inst))
                self._probes.add(probe)  # the loop holds tasks weakly: keep it until done
                probe.add_done_callback(self._probes.discard)
        if inst.is_draining != is_draining:
            logger.info("instance %s %s", url, "draining" if is_draining else "taking work again")
        inst.is_draining = is_draining
        inst.last_heartbeat_s = time.monotonic()
        return inst

    def deregister(self, url: str) -> bool:
        """Forget `url` (it has drained and is going away). False if it was not known."""
        inst = self.find(normalize_url(url))
        if inst is None:
            return False
        self._remove(inst, "deregistered")
        return True

    def find(self, url: str) -> Instance | None:
        return next((inst for inst in self.instances if inst.url == url), None)

    def expire(self, now_s: float) -> list[Instance]:
        """Drop registered instances whose heartbeats stopped `heartbeat_timeout_s` ago."""
        gone = [
            inst
            for inst in self.instances
            if inst.source == "registered"
            and inst.last_heartbeat_s is not None
            and now_s - inst.last_heartbeat_s > self.cfg.heartbeat_timeout_s
        ]
        for inst in gone:
            self._remove(inst, f"no heartbeat for {self.cfg.heartbeat_timeout_s:g}s")
        return gone

    def _remove(self, inst: Instance, why: str) -> None:
        pool = self.prefill if inst in self.prefill else self.decode
        pool.remove(inst)
        logger.warning("instance %s (%s) removed: %s", inst.url, inst.role, why)

    def _pool_for(self, role: str) -> PoolName:
        if role == self.decode_role:
            return "decode"
        if role == "prefill" and self.cfg.mode != "aggregated":
            return "prefill"
        wanted = "both" if self.cfg.mode == "aggregated" else "prefill or decode"
        raise MembershipError(f"a {self.cfg.mode} router takes {wanted} instances, not {role!r}")

    def pick(self, pool: PoolName, prompt_ids: list[int] | None = None) -> Instance:
        """Ask the pool's policy; raises NoHealthyInstanceError when nothing is healthy.
        `prompt_ids`: the request's, when known, for a policy that weighs cached prefixes."""
        candidates = self.prefill if pool == "prefill" else self.decode
        now_s = time.monotonic()
        views = [inst.view(now_s) for inst in candidates]
        if prompt_ids and self.kv_index is not None:  # D's cache counts too: it reuses it
            views = with_cached_tokens(self.kv_index, views, prompt_ids)
        chosen = candidates[self._policies[pool].choose(views)]
        chosen.num_pending += 1
        chosen.breaker.on_picked(now_s)
        return chosen

    def uncached_at_next_decode_pick(self, prompt_ids: list[int]) -> int | None:
        """Prompt tokens the cache of the decode instance kv_aware would pick now lacks (by
        the index): decode-first, the pick is made and then asked. None without an index."""
        if self.kv_index is None or self.cfg.policy != "kv_aware":
            return None
        views = [inst.view(time.monotonic()) for inst in self.decode]
        views = with_cached_tokens(self.kv_index, views, prompt_ids)
        return uncached_at_pick(self._policies["decode"], views)

    def note_served(self, inst: Instance) -> None:
        """A leg this instance answered (any status it chose to give: a 4xx is the request's)."""
        inst.breaker.on_served()

    def note_failed(self, inst: Instance, reason: str) -> bool:
        """A leg it did not serve (unreachable, broken, timed out, 502/503/504). True when
        this failure opened its breaker."""
        is_opened = inst.breaker.on_failed(time.monotonic())
        if is_opened:
            logger.warning("instance %s (%s): circuit open for %gs after %d failures (%s)",
                           inst.url, inst.role, inst.breaker.cooldown_s,
                           inst.breaker.num_failures, reason)  # fmt: skip
        return is_opened

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Probe every instance once (so the first request sees real health), then poll."""
        self._session = session
        await self.poll_health()
        self._task = asyncio.create_task(self._poll_forever(), name="router-instance-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def mark_unhealthy(self, inst: Instance, reason: str) -> None:
        if inst.is_healthy:
            logger.warning("instance %s (%s) unhealthy: %s", inst.url, inst.role, reason)
        inst.is_healthy = False
        inst.load = None
        inst.identity = None  # a restarted instance may come back with a new KV identity

    async def poll_health(self) -> None:
        await asyncio.gather(*(self._probe_health(inst) for inst in self.instances))

    async def refresh_load(
        self, instances: Sequence[Instance], timeout_s: float = PROBE_TIMEOUT_S
    ) -> None:
        """Fetch /load of the healthy ones now; a failed fetch keeps the previous snapshot."""
        healthy = [inst for inst in instances if inst.is_healthy]
        await asyncio.gather(*(self._probe_load(inst, timeout_s) for inst in healthy))

    async def get_identity(self, inst: Instance) -> Identity:
        """Cached identity; probed on a miss (identify.py). Raises aiohttp.ClientError,
        TimeoutError or ValueError when the instance cannot tell."""
        if inst.identity is None:
            declared = self.declared.get(inst.url)

            async def get(path: str) -> tuple[int, Any]:
                return await self._get_answer(inst, path)

            inst.identity = await identify(get, self.cfg.engine, declared)
            if (odd := mismatch_warning(inst.identity, inst.role, self.cfg.mode)) is not None:
                logger.warning("instance %s %s", inst.url, odd)
        return inst.identity

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_health_s = loop.time() + self.health_interval_s
        interval_s = self.health_interval_s
        if self.uses_load:
            interval_s = min(interval_s, self.cfg.load_poll_interval_s)
        while True:
            await asyncio.sleep(interval_s)
            if loop.time() >= next_health_s:
                next_health_s = loop.time() + self.health_interval_s
                self.expire(time.monotonic())
                await self.poll_health()
            if self.uses_load:
                await self.refresh_load(self.instances)

    async def _probe_health(self, inst: Instance) -> None:
        assert self._session is not None, "InstancePool.start() not called"
        url = f"{inst.url}/health"
        try:
            timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with self._session.get(url, timeout=timeout) as resp:
                is_ok = resp.status == 200
                reason = f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            is_ok, reason = False, f"/health failed: {exc!r}"
        if not is_ok:
            self.mark_unhealthy(inst, reason)
        elif not inst.is_healthy:
            await self._on_healthy(inst)

    async def _on_healthy(self, inst: Instance) -> None:
        """Transition to healthy: refresh what a restart may have changed before routing to it;
        an instance of a kind or connector this router cannot drive stays out (`problem`)."""
        inst.identity = None
        inst.breaker.on_served()  # a restarted instance starts with a clean record
        if not await self._is_drivable(inst):
            return
        if self.uses_load and not await self._probe_load(inst, PROBE_TIMEOUT_S):
            return  # gone again between /health and /load
        inst.is_healthy = True
        logger.info("instance %s (%s) healthy", inst.url, inst.role)

    async def _is_drivable(self, inst: Instance) -> bool:
        """Identify `inst` and keep it out when this router cannot drive it (logged once per
        reason, shown in /instances)."""
        try:
            identity = await self.get_identity(inst)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            problem: str | None = f"cannot tell what it is: {exc or type(exc).__name__}"
        else:
            others = {i.identity.engine for i in self.instances
                      if i is not inst and i.is_healthy and i.identity is not None}  # fmt: skip
            problem = refusal(identity, inst.role, self.cfg.mode, self.cfg.engine, others)
            if problem is None and problem != inst.problem:
                logger.info("instance %s (%s) is %s", inst.url, inst.role, identity.describe())
        if problem is not None and problem != inst.problem:
            logger.error("instance %s (%s) takes no work: %s", inst.url, inst.role, problem)
        inst.problem = problem
        return problem is None

    async def _probe_load(self, inst: Instance, timeout_s: float) -> bool:
        """Refresh `inst.load`; False when the instance could not be reached at all."""
        try:
            if inst.is_vllm:  # its /load is not ours: its gauges
                load = load_from_vllm_metrics(await self._get_text(inst, "/metrics", timeout_s))
            else:
                load = Load.from_dict(await self._get_json(inst, "/load", timeout_s))
        except aiohttp.ClientConnectionError as exc:
            self.mark_unhealthy(inst, f"/load failed: {exc!r}")
            return False
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.debug("instance %s: /load failed: %r", inst.url, exc)
            return True
        inst.load = load
        inst.num_pending = 0  # the snapshot now counts what we had sent
        return True

    async def _get_json(self, inst: Instance, path: str, timeout_s: float) -> Any:
        assert self._session is not None, "InstancePool.start() not called"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.get(f"{inst.url}{path}", timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def _get_text(self, inst: Instance, path: str, timeout_s: float) -> str:
        assert self._session is not None, "InstancePool.start() not called"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.get(f"{inst.url}{path}", timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.text()

    async def _get_answer(self, inst: Instance, path: str) -> tuple[int, Any]:
        """(status, JSON answer or None) of GET `path`; raises only when nothing answers."""
        assert self._session is not None, "InstancePool.start() not called"
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        async with self._session.get(f"{inst.url}{path}", timeout=timeout) as resp:
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, None
