"""The simulated connector worker's common half: reports, loop time and wake-ups.

Subclasses (pull_worker.py, push_worker.py) implement the real `KVConnectorWorker` contract, so
the engine-side wiring in `SimInstance` is the same as `Engine.step`'s. Time is the fabric's
virtual clock; work done "on the engine loop" is added to `loop_busy_s`, which the instance
turns into step time (every running decode waits for it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.engine.kv_connector import KVConnectorWorker
from disagg.engine.outputs import KVConnectorOutput
from disagg.sim.fabric import Fabric

__all__ = ["SimKVWorker"]


class SimKVWorker(KVConnectorWorker):
    def __init__(self, engine_id: str, role: str, fabric: Fabric) -> None:
        self.engine_id = engine_id
        self.role = role  # "prefill" | "decode"
        self.fabric = fabric
        self.wake: Callable[[], None] = lambda: None  # set by the instance: step soon
        self.loop_busy_s = 0.0  # engine-loop time spent in start_load since the instance reset it
        self._report = KVConnectorOutput()
        fabric.add(self)

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
