"""A client request's way through the cluster, once admitted: the mode's flow, and under policy
recompute the fallback when the prefill leg fails.

Owns choosing the flow (aggregated here; pull_flow.py, push_flow.py), the request's retry
budget and recompute on a decode instance. Must not parse requests or hold admission slots
(app.py) nor send legs itself (legs.py).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from disagg.config import RouterConfig
from disagg.router.call import Call
from disagg.router.instances import InstancePool
from disagg.router.legs import Legs
from disagg.router.metrics import RouterMetrics
from disagg.router.policy import NoHealthyInstanceError
from disagg.router.pull_flow import PullFlow
from disagg.router.push_flow import PushFlow
from disagg.router.relay import Relayed, RouteError
from disagg.router.retry import RetryBudget

__all__ = ["AggregatedFlow", "Flow", "Flows"]

logger = logging.getLogger(__name__)


class Flow(Protocol):
    """One mode's flow: AggregatedFlow, PullFlow, PushFlow."""

    async def run(self, call: Call, retries: RetryBudget) -> Relayed:
        """Serve `call`, resending legs that never reached their instance from `retries`.
        Raises RouteError (its `leg` names the failed leg) or NoHealthyInstanceError."""
        ...


class AggregatedFlow:
    """The whole request to one instance of the decode pool."""

    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def run(self, call: Call, retries: RetryBudget) -> Relayed:
        started_s = time.monotonic()
        _, resp = await self.legs.retrying(
            call,
            "decode",
            retries,
            lambda inst: self.legs.send(inst, call, call.body, "aggregated"),
        )
        return await self.legs.respond(call, resp, "aggregated", started_s, None)


class Flows:
    """The flow of the router's mode, and recompute when the policy asks for it."""

    def __init__(
        self, cfg: RouterConfig, legs: Legs, pool: InstancePool, metrics: RouterMetrics
    ) -> None:
        self.cfg = cfg
        self.legs = legs
        self.metrics = metrics
        self.pool = pool
        self.flow = _flow_for(cfg, legs, pool)

    async def dispatch(self, call: Call) -> Relayed:
        """The request's flow; under policy recompute a failed prefill leg becomes a whole
        request to a decode instance."""
        retries = RetryBudget.of(self.cfg)
        try:
            try:
                if self._prefills_locally(call):
                    return await self._on_decode(call, retries, "local_prefill")
                if self.cfg.mode != "aggregated":
                    self.metrics.prefill_placement.labels(where="remote_prefill").inc()
                return await self.flow.run(call, retries)
            except RouteError as exc:
                if not self._should_recompute(exc):
                    raise
                return await self._recompute_on_decode(call, exc, retries)
        except NoHealthyInstanceError as exc:
            raise RouteError.of(503, str(exc)) from exc

    def _prefills_locally(self, call: Call) -> bool:
        """Conditional disaggregation: the decode instance that caches most of the prompt
        lacks at most --local-prefill-tokens of it, so it computes them itself rather than
        wait for a prefill instance's queue, a handoff and a transfer."""
        limit = self.cfg.local_prefill_tokens
        if not (limit and call.prompt_ids and self.cfg.mode != "aggregated"):
            return False
        uncached = self.pool.uncached_at_next_decode_pick(call.prompt_ids)
        return uncached is not None and uncached <= limit

    def _should_recompute(self, exc: RouteError) -> bool:
        """Policy `recompute`: a prefill instance that died or hung (5xx, nothing streamed yet)
        costs the client its disaggregation, not its answer, and so does having no healthy
        prefill instance at all. A 4xx is the request's fault."""
        return (
            self.cfg.failure_policy == "recompute"
            and self.cfg.mode != "aggregated"
            and exc.leg == "prefill"
            and exc.status >= 500
        )

    async def _recompute_on_decode(
        self, call: Call, cause: RouteError, retries: RetryBudget
    ) -> Relayed:
        """The whole request to a decode instance, which prefills it itself. A fresh id: the
        abandoned legs' ids may still be held while their aborts land."""
        logger.warning("request %s: prefill leg failed (%s); prefilling on a decode instance",
                       call.request_id, cause)  # fmt: skip
        self.metrics.recomputed.inc()
        return await self._on_decode(call.retry(f"{call.request_id}-local"), retries)

    async def _on_decode(
        self, local: Call, retries: RetryBudget, placement: str | None = None
    ) -> Relayed:
        """`local`, the whole request, to the decode instance the policy picks."""
        if placement is not None:
            self.metrics.prefill_placement.labels(where=placement).inc()
        started_s = time.monotonic()
        _, resp = await self.legs.retrying(
            local, "decode", retries, lambda inst: self.legs.send(inst, local, local.body, "decode")
        )
        return await self.legs.respond(local, resp, "decode", started_s, None)


def _flow_for(cfg: RouterConfig, legs: Legs, pool: InstancePool) -> Flow:
    if cfg.mode == "pull":
        return PullFlow(legs, pool)
    if cfg.mode == "push":
        return PushFlow(legs, pool)
    return AggregatedFlow(legs)
