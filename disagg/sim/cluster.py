"""A simulated cluster: build instances for a `SimConfig`, replay the workload, collect results.

`run_simulation` returns a result dict with the same keys as `disagg bench` (the bench's own
metric code computes them from per-request timestamps) plus `"simulated": true` and the sim's
own figures.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.bench.arrivals import arrival_offsets_s
from disagg.bench.flags import workload_keys
from disagg.bench.metrics import RequestResult, compute_metrics
from disagg.bench.workload import make_workload
from disagg.config import SchedulerConfig
from disagg.engine.block_pool import BlockPool
from disagg.engine.kv_connector import KVConnectorScheduler
from disagg.engine.kv_events import KVEventLog
from disagg.engine.scheduler import Scheduler
from disagg.kv.common import KVIdentity
from disagg.kv.pull import PullScheduler
from disagg.kv.push import PushScheduler
from disagg.sim.conversations import submit_conversations
from disagg.sim.cost import CostModel
from disagg.sim.events import EventLoop
from disagg.sim.fabric import Fabric
from disagg.sim.hardware import load_profile
from disagg.sim.host_cpu import CpuShare
from disagg.sim.instance import SimInstance
from disagg.sim.kv_worker import SimKVWorker
from disagg.sim.model_shape import load_shape
from disagg.sim.pull_worker import SimPullWorker
from disagg.sim.push_worker import SimPushWorker
from disagg.sim.router import ClientRequest, SimRouter
from disagg.sim.runner import SimRunner
from disagg.sim.sim_config import SimConfig

__all__ = ["SimCluster", "run_simulation"]

_LEASE_S = 3600.0  # the sim never expires a pull lease: no failures are injected


@dataclass(slots=True)
class SimCluster:
    config: SimConfig
    cost: CostModel
    loop: EventLoop
    fabric: Fabric
    instances: list[SimInstance]
    router: SimRouter
    num_blocks: int
    cpu: CpuShare

    @classmethod
    def build(cls, config: SimConfig) -> SimCluster:
        cost = CostModel(
            load_shape(config.model), load_profile(config.hardware), config.tp, config.layout
        )
        num_blocks = config.num_blocks or cost.num_blocks(config.block_size)
        loop = EventLoop()
        fabric = Fabric(loop, cost, config.block_size)
        cpu = CpuShare(loop, cost.hardware.host)
        instances = [
            _instance(config, cost, loop, fabric, role, index, num_blocks, cpu)
            for role, count in _roles(config)
            for index in range(count)
        ]
        hop_s = cost.hardware.http_hop_s
        router = SimRouter(
            config.mode,
            instances,
            loop,
            hop_s,
            policy=config.policy,
            max_concurrency=config.max_concurrency,
            request_tokens=config.kv_aware_request_tokens,
            local_prefill_tokens=config.local_prefill_tokens,
            cpu=cpu,
        )
        return cls(config, cost, loop, fabric, instances, router, num_blocks, cpu)

    def submit_workload(self) -> None:
        cfg = self.config
        if cfg.workload.dataset == "multiturn":
            submit_conversations(cfg, self.router, self.loop)
            return
        prompts = make_workload(cfg.workload)
        offsets = arrival_offsets_s(
            len(prompts), cfg.request_rate, cfg.burstiness, cfg.workload.seed
        )
        rng = np.random.default_rng(cfg.workload.seed)
        lo, hi = cfg.workload.token_range
        for index, (prompt, offset) in enumerate(zip(prompts, offsets, strict=True)):
            ids = prompt.prompt
            if isinstance(ids, str):  # text workload: only its lengths matter here
                ids = [int(t) for t in rng.integers(lo, hi, size=prompt.input_len)]
            request = ClientRequest(
                request_id=f"r{index}",
                prompt_token_ids=ids if isinstance(ids, list) else list(ids),
                output_len=prompt.output_len,
                result=RequestResult(input_len=len(ids)),
            )
            self.loop.at(offset, lambda r=request: self.router.submit(r))

    def run(self) -> None:
        self.submit_workload()
        # The run allocates millions of small objects (block digests, token lists) that live
        # until their request ends; the collector's passes over them were ~7% of a 16k-token
        # run's time and find no cycles worth having (it runs again once the run is over).
        gc.disable()
        try:
            self.loop.run()
        finally:
            gc.enable()

    def check_drained(self) -> None:
        """Every request answered; every instance idle with its whole pool free."""
        unfinished = [r.request_id for r in self.router.requests.values() if not r.is_done]
        assert not unfinished, f"requests never finished: {unfinished[:8]}"
        for instance in self.instances:
            s = instance.scheduler
            assert not s.requests and not s.has_kv_pending, f"{instance.engine_id} holds requests"
            s.check_integrity()
            pool = s.block_pool
            assert pool.num_free_blocks == pool.num_blocks, f"{instance.engine_id} leaks blocks"
            assert instance.worker is None or not instance.worker.has_pending()


def _roles(config: SimConfig) -> list[tuple[str, int]]:
    if config.mode == "aggregated":
        return [("both", config.num_instances)]
    return [("prefill", config.num_prefill), ("decode", config.num_decode)]


def _instance(
    config: SimConfig,
    cost: CostModel,
    loop: EventLoop,
    fabric: Fabric,
    role: str,
    index: int,
    num_blocks: int,
    cpu: CpuShare,
) -> SimInstance:
    engine_id = f"{role}-{index}"
    connector: KVConnectorScheduler | None = None
    worker: SimKVWorker | None = None
    if role != "both":
        identity = KVIdentity(engine_id=engine_id, host="sim", port=1 + index)
        if config.is_pull:
            connector = PullScheduler(config.block_size, identity, _LEASE_S)
            worker = SimPullWorker(engine_id, role, fabric, inline=config.mode == "pull-inline")
        else:
            connector = PushScheduler(config.block_size, identity)
            worker = SimPushWorker(engine_id, role, fabric)
    sched_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.resolved_max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    # kv_aware's router follows what each prefix cache holds (the real instances publish it)
    followed = config.policy == "kv_aware" and config.enable_prefix_caching
    events = KVEventLog() if followed else None
    pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching, events=events)
    scheduler = Scheduler(sched_config, pool, config.block_size, connector=connector)
    return SimInstance(engine_id, role, scheduler, SimRunner(cost), worker, loop, events, cpu)


def _header(config: SimConfig, cluster: SimCluster) -> dict[str, Any]:
    """The keys `disagg bench` writes before its metrics, with the sim's values."""
    w = config.workload
    rate = config.request_rate
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "sim",
        "base_url": None,
        "host": None,  # no machine served it: the simulated hardware is sim.hardware
        "endpoint": "/v1/completions",
        "model_id": cluster.cost.shape.name,
        **workload_keys(w),
        "request_rate": rate if rate != float("inf") else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "warmup": 0,
        "goodput_slos_ms": dict(config.goodput_slos_ms),
    }


def _sim_figures(cluster: SimCluster, wall_s: float) -> dict[str, Any]:
    c = cluster.config
    num_requests = len(cluster.router.requests)
    return {
        "simulated": True,
        "sim": {
            "mode": c.mode,
            "num_prefill": c.num_prefill,
            "num_decode": c.num_decode if c.mode != "aggregated" else 0,
            "num_instances": c.num_instances,
            "num_gpus": c.num_gpus,
            "hardware": cluster.cost.hardware.name,
            "tp": c.tp,
            "layout": c.layout,
            "block_size": c.block_size,
            "num_blocks": cluster.num_blocks,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_num_seqs": c.max_num_seqs,
            "policy": c.policy,
            "local_prefill_tokens": c.local_prefill_tokens,
            "num_local_prefills": cluster.router.num_local_prefills,
            "num_events": cluster.loop.num_events,
            "max_cpu_slowdown": cluster.cpu.max_slowdown,
            "wall_s": wall_s,
            "requests_per_wall_s": num_requests / wall_s if wall_s > 0 else None,
        },
        "instances": {
            i.engine_id: {
                "num_steps": i.num_steps,
                "busy_s": i.busy_s,
                "loop_stalled_s": i.stalled_s,
                "num_preemptions": i.scheduler.num_preemptions,
            }
            for i in cluster.instances
        },
    }


def run_simulation(config: SimConfig) -> tuple[dict[str, Any], SimCluster]:
    """Simulate `config`'s workload; (bench-keyed result, the drained cluster)."""
    started = time.perf_counter()
    cluster = SimCluster.build(config)
    cluster.run()
    cluster.check_drained()
    wall_s = time.perf_counter() - started
    results = [r.result for r in cluster.router.requests.values()]
    duration_s = max((r.end_s for r in results), default=0.0) - min(
        (r.start_s for r in results), default=0.0
    )
    metrics = compute_metrics(
        results, max(duration_s, 1e-9), config.percentiles, config.goodput_slos_ms or None
    )
    return {**_header(config, cluster), **metrics, **_sim_figures(cluster, wall_s)}, cluster
