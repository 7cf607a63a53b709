"""One simulated engine instance: the real `Scheduler` stepped on the virtual clock.

`_step` / `_end_step` call the engine's own step halves (engine/step.py) around the model call:
`begin` (schedule, start KV work: inline setup is loop time) -> [the model step takes cost-model
time] -> `finish` (poll KV, update, start the KV work update raised). Between steps with nothing
to do the instance sleeps until a request or a KV report wakes it.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg.engine.kv_events import KVEventLog
from disagg.engine.outputs import SchedulerOutput
from disagg.engine.request import Request
from disagg.engine.scheduler import Scheduler
from disagg.engine.step import EngineStep
from disagg.protocol import RequestOutput
from disagg.sim.events import EventLoop
from disagg.sim.host_cpu import CpuShare
from disagg.sim.kv_worker import SimKVWorker
from disagg.sim.runner import SimRunner

__all__ = ["OutputSink", "SimInstance"]

# (instance, outputs, time they left the engine) -> None
OutputSink = Callable[["SimInstance", list[RequestOutput]], None]


class SimInstance:
    def __init__(
        self,
        engine_id: str,
        role: str,
        scheduler: Scheduler,
        runner: SimRunner,
        worker: SimKVWorker | None,
        loop: EventLoop,
        kv_events: KVEventLog | None = None,
        cpu: CpuShare | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.role = role  # "prefill" | "decode" | "both"
        self.scheduler = scheduler
        self.runner = runner
        self.worker = worker
        self.loop = loop
        self.kv_events = kv_events  # what the pool's prefix cache holds, for kv_aware routing
        self.cpu = cpu or CpuShare(loop, None)  # the host's cores, shared with the others
        self.stepper = EngineStep(scheduler, worker)
        self.on_outputs: OutputSink = lambda instance, outputs: None
        self.busy_s = 0.0  # CPU time of its steps (model + loop-blocking KV setup)
        self.stalled_s = 0.0  # of which: KV setup on the loop
        self._is_stepping = False  # a step is scheduled or running
        self._is_woken = False  # something arrived while stepping: step again after
        if worker is not None:
            worker.wake = self.wake

    @property
    def num_steps(self) -> int:
        return self.stepper.num_steps

    def add_request(self, request: Request) -> None:
        request.arrival_s = self.loop.now_s
        self.scheduler.add_request(request)
        self.wake()

    def wake(self) -> None:
        if self._is_stepping:
            self._is_woken = True
            return
        self._is_stepping = True
        self.loop.after(0.0, self._step)

    def _step(self) -> None:
        self._is_woken = False
        sched = self.stepper.begin(self.loop.now_s)
        stall_s = self._take_stall_s()
        work_s = stall_s + self.runner.duration_s(sched)
        self.busy_s += work_s
        self.stalled_s += stall_s
        # On a crowded host the engine thread takes its turn on the cores (host_cpu.py).
        self.cpu.run(work_s, lambda: self._end_step(sched))

    def _end_step(self, sched: SchedulerOutput) -> None:
        runner_out = self.runner.execute(sched)
        outputs = self.stepper.finish(sched, runner_out, self.loop.now_s)
        stall_s = self._take_stall_s()
        self.busy_s += stall_s
        self.stalled_s += stall_s
        if outputs:
            self.on_outputs(self, outputs)
        has_progress = not sched.is_empty or not runner_out.kv.is_empty
        if self._is_woken or (self.scheduler.has_unfinished and has_progress):
            self.loop.after(stall_s, self._step)
        else:
            self._is_stepping = False  # asleep until a request or a KV report arrives

    def _take_stall_s(self) -> float:
        """The loop time the step half just run spent starting KV work (inline setup)."""
        return 0.0 if self.worker is None else self.worker.take_loop_busy_s()
