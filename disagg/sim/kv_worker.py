"""The simulated connector worker's common half: reports, loop time and wake-ups.

Subclasses (pull_worker.py, push_worker.py) implement the real `KVConnectorWorker` contract
(their `_start_load` is its `start_load`), so `SimInstance` drives them through the engine's own
step halves (engine/step.py). Time is the fabric's virtual clock; work done "on the engine loop"
is added to `loop_busy_s`, which the instance takes as step time (every running decode waits).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from disagg.engine.kv_connector import KVConnectorMeta, KVConnectorWorker
from disagg.engine.outputs import KVConnectorOutput
from disagg.sim.fabric import Fabric

__all__ = ["SimKVWorker"]


class SimKVWorker(KVConnectorWorker):
    def __init__(self, engine_id: str, role: str, fabric: Fabric) -> None:
        self.engine_id = engine_id
        self.role = role  # "prefill" | "decode"
        self.fabric = fabric
        self.wake: Callable[[], None] = lambda: None  # set by the instance: step soon
        self.loop_busy_s = 0.0  # engine-loop time spent so far in this start_load call
        self._loop_busy_untaken_s = 0.0  # loop time of the calls since take_loop_busy_s
        self._report = KVConnectorOutput()
        fabric.add(engine_id, self)

    def start_load(self, meta: KVConnectorMeta) -> None:
        self.loop_busy_s = 0.0
        self._start_load(meta)
        self._loop_busy_untaken_s += self.loop_busy_s

    @abc.abstractmethod
    def _start_load(self, meta: KVConnectorMeta) -> None:
        """`start_load`'s work; loop time it spends goes into `loop_busy_s`."""

    def charge_loop_s(self, busy_s: float) -> None:
        """Engine-loop time spent outside `start_load` (a call handled in the same
        interpreter): taken as stall by the instance's next step (none if it is idle)."""
        self._loop_busy_untaken_s += busy_s

    def take_loop_busy_s(self) -> float:
        """Loop time spent in `start_load` since the last call (the instance's stall)."""
        busy_s, self._loop_busy_untaken_s = self._loop_busy_untaken_s, 0.0
        return busy_s

    @property
    def now_s(self) -> float:
        return self.fabric.loop.now_s

    def get_finished(self) -> KVConnectorOutput:
        report, self._report = self._report, KVConnectorOutput()
        return report

    def report_received(
        self, request_id: str, stages: dict[str, float], first_token: int | None = None
    ) -> None:
        self._report.finished_recving.add(request_id)
        self._report.stages[request_id] = stages
        if first_token is not None:
            self._report.first_token_ids[request_id] = first_token
        self.wake()

    def report_sent(self, request_id: str) -> None:
        self._report.finished_sending.add(request_id)
        self.wake()

    def report_settled(self, request_id: str) -> None:
        """The simulator injects no failures, so nothing is ever in flight when one aborts."""
        self._report.settled.add(request_id)
        self.wake()

    def info(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "role": self.role}
