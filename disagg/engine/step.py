"""The engine step, written once, in the two halves around the model call.

`begin` schedules and starts the step's KV loads; `finish` polls the connector worker, updates
the scheduler and starts the KV work the update raised. `Engine.step` runs the model between
them on the wall clock; the simulator (sim/instance.py) calls the same halves on its virtual
clock with a cost-model duration in between, so a change to the step changes both. It holds no
model, no tensors and reads no clock: the caller passes the time in.
"""

from __future__ import annotations

from disagg.engine.kv_connector import KVConnectorMeta, KVConnectorWorker
from disagg.engine.outputs import RunnerOutput, SchedulerOutput
from disagg.engine.scheduler import Scheduler
from disagg.protocol import RequestOutput

__all__ = ["EngineStep"]


class EngineStep:
    def __init__(self, scheduler: Scheduler, kv_worker: KVConnectorWorker | None) -> None:
        self.scheduler = scheduler
        self.kv_worker = kv_worker
        self.num_steps = 0  # finished steps

    def begin(self, now_s: float) -> SchedulerOutput:
        """Schedule the step and start its KV loads; the model call comes next."""
        sched = self.scheduler.schedule(now_s)
        self.start_kv(sched.kv_meta)  # inline pull: READs are posted here, on the loop
        return sched

    def finish(
        self, sched: SchedulerOutput, runner_out: RunnerOutput, now_s: float
    ) -> list[RequestOutput]:
        """After the model call: poll the worker, update, and start what the update raised."""
        if self.kv_worker is not None:
            runner_out.kv = self.kv_worker.get_finished()
        self.num_steps += 1
        outputs = self.scheduler.update(sched, runner_out, now_s)
        # Sends and aborts that update() raised reach the worker before the outputs leave.
        self.start_kv(self.scheduler.take_kv_meta())
        return outputs

    def start_kv(self, meta: object) -> None:
        """Hand the connector's metadata to the worker (nothing to do when it is empty)."""
        if self.kv_worker is not None and isinstance(meta, KVConnectorMeta) and not meta.is_empty:
            self.kv_worker.start_load(meta)
