"""One engine instance: scheduler + KV connector + model runner, stepped by one thread.

`Engine.step()` is the architecture diagram: begin (schedule, start KV loads) -> run the model
-> finish (poll KV transfers, update); the halves live in step.py, which the simulator calls too.
It is not thread-safe; `AsyncEngine` calls it from its loop thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from disagg.config import EngineConfig
from disagg.engine.block_pool import BlockPool
from disagg.engine.kv_events import KVEventLog
from disagg.engine.model_runner import ModelRunner
from disagg.engine.outputs import RunnerOutput, SchedulerOutput
from disagg.engine.request import Request
from disagg.engine.scheduler import Scheduler
from disagg.engine.step import EngineStep
from disagg.protocol import KVTransferParams, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from disagg.engine.kv_connector import KVConnectorScheduler, KVConnectorWorker

# (config, runner, wake=...) -> (scheduler half, worker half)
ConnectorFactory = Callable[..., "tuple[KVConnectorScheduler, KVConnectorWorker]"]

__all__ = ["Engine"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        *,
        wake: object = None,
        make_connector: ConnectorFactory | None = None,
    ) -> None:
        """`make_connector(config, runner, wake=...)` builds the two halves of a prefill or
        decode engine's KV connector (the server passes disagg.kv.factory.make_connector):
        injected, so the engine package never imports the kv package that implements its
        contract. The scheduler half goes to the Scheduler; the worker half is `kv_worker`."""
        self.config = config
        if config.num_threads > 0:
            import torch

            torch.set_num_threads(config.num_threads)  # several processes share the cores
        self.runner = ModelRunner(config, model_dir)
        self.spec = self.runner.spec
        self.max_model_len = min(config.scheduler.max_model_len, self.spec.max_position_embeddings)
        capacity = config.cache.num_blocks * config.cache.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"num_blocks * block_size = {capacity} tokens cannot hold one request of "
                f"max_model_len {self.max_model_len}; raise num_blocks or lower max_model_len"
            )
        caching = config.scheduler.enable_prefix_caching
        # What the prefix cache holds, for a router that places requests where their KV is.
        self.kv_events = KVEventLog() if caching else None
        self.block_pool = BlockPool(
            config.cache.num_blocks, enable_caching=caching, events=self.kv_events
        )
        kv_scheduler, self.kv_worker = self._make_connector(make_connector, wake)
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_pool,
            config.cache.block_size,
            eos_token_ids=tuple(self.spec.eos_token_ids),
            connector=kv_scheduler,
        )
        self.stepper = EngineStep(self.scheduler, self.kv_worker)

    def _make_connector(
        self, factory: ConnectorFactory | None, wake: object
    ) -> tuple[KVConnectorScheduler | None, KVConnectorWorker | None]:
        if not self.config.kv_transfer.is_disaggregated:
            return None, None
        if factory is None:
            role = self.config.kv_transfer.role
            raise ValueError(f"a {role} engine needs a KV connector factory (make_connector)")
        return factory(self.config, self.runner, wake=wake)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        arrival_s: float | None = None,
    ) -> None:
        """`arrival_s` (monotonic) is when the caller submitted it: a request that arrives
        while a step runs waits for that step, and its queue time must say so."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival_s=time.monotonic() if arrival_s is None else arrival_s,
            kv_transfer_params=kv_transfer_params,
        )
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id, time.monotonic())

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished or self.scheduler.has_kv_pending

    def step(self) -> list[RequestOutput]:
        sched = self.stepper.begin(time.monotonic())
        runner_out = self._execute(sched)
        return self.stepper.finish(sched, runner_out, time.monotonic())

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs produced between steps (an abort while idle): publish them now, or the
        aborted client waits for the next step that may never come."""
        self.stepper.start_kv(self.scheduler.take_kv_meta())  # the aborts, for the worker
        return self.scheduler.take_pending_outputs()

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the model; a step that raises fails the requests it held, not the engine.
        The runner keeps no per-request state, so the next step starts clean."""
        try:
            return self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001 - any model error is this batch's, not the loop's
            ids = [s.request_id for s in sched.requests]
            log.exception("model step failed; failing its %d requests: %s", len(ids), ids)
            reason = f"model step failed: {type(exc).__name__}: {exc}"
            return RunnerOutput(failed=dict.fromkeys(ids, reason))

    def close(self) -> None:
        if self.kv_worker is not None:
            self.kv_worker.close()
