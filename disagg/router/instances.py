"""Typed records of the instances behind the router, and the background task that keeps them fresh.

Owns each instance's health (`/health`), load (`/load`), KV identity (`/kv_info`) and circuit
breaker (fed each leg's outcome by legs.py), the live membership (instances named on the command
line, plus those that register themselves and keep heartbeating), and turns a policy's choice
into an `Instance`. Must not proxy requests (legs.py) nor rank instances (policy.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import yarl

from disagg.config import RouterConfig
from disagg.router.breaker import CircuitBreaker
from disagg.router.kv_index import KV_AWARE_INDEX_BLOCKS, KVIndex, with_cached_tokens
from disagg.router.policy import (
    InstanceRole,
    InstanceView,
    Load,
    Policy,
    make_policy,
    uncached_at_pick,
)

__all__ = [
    "HEALTH_POLL_INTERVAL_S",
    "Instance",
    "InstancePool",
    "KVInfo",
    "MembershipError",
    "normalize_url",
]

logger = logging.getLogger(__name__)

HEALTH_POLL_INTERVAL_S = 0.5  # how often /health is probed; load polling has its own interval
PROBE_TIMEOUT_S = 2.0  # one /health, /load or /kv_info probe
LATE_BINDING_TIMEOUT_S = 0.5  # /load refresh on a request's path: stale beats a slow TTFT

PoolName = Literal["prefill", "decode"]
Source = Literal["static", "registered"]  # named on the command line, or registered itself


class MembershipError(ValueError):
    """A registration the router refuses (a role this mode does not use)."""


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`; ValueError if it is no base URL."""
    url = url.strip().rstrip("/")
    url = url if "://" in url else f"http://{url}"
    try:
        parsed = yarl.URL(url)
        is_ok = parsed.scheme in ("http", "https") and bool(parsed.host)
        is_ok = is_ok and not any(c.isspace() for c in url)
    except (ValueError, TypeError):
        is_ok = False
    if not is_ok:
        raise ValueError(f"instance URL must look like http://host:port, got {url!r}")
    return url


@dataclass(frozen=True, slots=True, kw_only=True)
class KVInfo:
    """An instance's `GET /kv_info`: who it is on the KV side channel."""

    role: str  # "prefill" | "decode" | "both"
    engine_id: str | None = None
    connector: str | None = None  # "pull" | "push"; None when role is "both"
    kv_host: str | None = None  # KV side-channel address peers connect to
    kv_port: int | None = None
    block_size: int | None = None  # tokens per KV block
    model: str | None = None

    @classmethod
    def from_dict(cls, raw: Any) -> KVInfo:
        if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
            raise ValueError(f"kv_info must be an object with a string role, got {raw!r}")
        port = raw.get("kv_port")
        if port is not None and type(port) is not int:
            raise ValueError(f"kv_info.kv_port must be an integer, got {port!r}")
        names = ("engine_id", "connector", "kv_host", "block_size", "model")
        return cls(role=raw["role"], kv_port=port, **{n: raw.get(n) for n in names})

    @property
    def is_addressable(self) -> bool:
        """True when a peer can reach this instance's KV (push needs it of P)."""
        return bool(self.engine_id) and bool(self.kv_host) and self.kv_port is not None


@dataclass(slots=True)
class Instance:
    """The router's live record of one instance. Mutated only by InstancePool."""

    url: str  # base URL, no trailing slash
    role: InstanceRole
    breaker: CircuitBreaker
    is_healthy: bool = False
    load: Load | None = None  # last /load answer; None until one arrives or after a failure
    num_pending: int = 0  # requests routed here since `load` was taken
    kv_info: KVInfo | None = None  # cached /kv_info; dropped when the instance goes unhealthy
    source: Source = "static"
    is_draining: bool = False  # finishing what it has; no new work goes to it
    last_heartbeat_s: float | None = None  # monotonic; registered instances only

    @property
    def takes_work(self) -> bool:
        return self.is_healthy and not self.is_draining

    def is_pickable(self, now_s: float) -> bool:
        """Healthy, not draining, and its breaker lets a leg through."""
        return self.takes_work and self.breaker.allows(now_s)

    def view(self, now_s: float) -> InstanceView:
        return InstanceView(
            url=self.url,
            role=self.role,
            is_healthy=self.is_pickable(now_s),  # never a draining one, nor an open breaker
            load=self.load,
            num_pending=self.num_pending,
        )

    def to_dict(self, now_s: float) -> dict[str, Any]:
        age = None if self.last_heartbeat_s is None else round(now_s - self.last_heartbeat_s, 3)
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.is_healthy,
            "draining": self.is_draining,
            "breaker": self.breaker.state.value,
            "source": self.source,
            "heartbeat_age_s": age,
            "engine_id": self.kv_info.engine_id if self.kv_info else None,
        }


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
        inst.kv_info = None  # a restarted instance may come back with a new KV identity

    async def poll_health(self) -> None:
        await asyncio.gather(*(self._probe_health(inst) for inst in self.instances))

    async def refresh_load(
        self, instances: Sequence[Instance], timeout_s: float = PROBE_TIMEOUT_S
    ) -> None:
        """Fetch /load of the healthy ones now; a failed fetch keeps the previous snapshot."""
        healthy = [inst for inst in instances if inst.is_healthy]
        await asyncio.gather(*(self._probe_load(inst, timeout_s) for inst in healthy))

    async def get_kv_info(self, inst: Instance) -> KVInfo:
        """Cached /kv_info; fetched on a miss. Raises aiohttp.ClientError, TimeoutError or
        ValueError when the instance cannot tell."""
        if inst.kv_info is None:
            inst.kv_info = KVInfo.from_dict(await self._get_json(inst, "/kv_info", PROBE_TIMEOUT_S))
            _warn_on_mismatch(inst, inst.kv_info, self.cfg.mode)
        return inst.kv_info

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
        """Transition to healthy: refresh what a restart may have changed before routing to it."""
        inst.kv_info = None
        inst.breaker.on_served()  # a restarted instance starts with a clean record
        if inst.role != "both":
            try:
                await self.get_kv_info(inst)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # Not fatal: push fetches it again on the request path.
                logger.warning("instance %s: /kv_info failed: %r", inst.url, exc)
        if self.uses_load and not await self._probe_load(inst, PROBE_TIMEOUT_S):
            return  # gone again between /health and /load
        inst.is_healthy = True
        logger.info("instance %s (%s) healthy", inst.url, inst.role)

    async def _probe_load(self, inst: Instance, timeout_s: float) -> bool:
        """Refresh `inst.load`; False when the instance could not be reached at all."""
        try:
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


def _warn_on_mismatch(inst: Instance, info: KVInfo, mode: str) -> None:
    if info.role != inst.role:
        logger.warning("instance %s is listed as %s but reports %s", inst.url, inst.role, info.role)
    if inst.role != "both" and info.connector not in (None, mode):
        logger.warning(
            "instance %s runs connector %s, router mode is %s", inst.url, info.connector, mode
        )
