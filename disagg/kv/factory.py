"""Build the two halves of the KV connector a deployment asks for (pull or push) around the
runner's KV tensor: the pure scheduler half for the Scheduler, the worker half for the Engine,
its threads started. Also where the fault-injection test hook is read (kv/faults.py)."""

from __future__ import annotations

import os
from typing import Any

from disagg.config import EngineConfig
from disagg.engine.kv_connector import KVConnectorScheduler, KVConnectorWorker
from disagg.kv.faults import KVFaults

__all__ = ["make_connector"]


def make_connector(
    config: EngineConfig, runner: Any, *, wake: Any = None
) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    block_size, kv = config.cache.block_size, config.kv_transfer
    faults = KVFaults.from_env(os.environ)
    if kv.connector == "pull":
        from disagg.kv.pull import PullScheduler, PullWorker

        pull = PullWorker(config, runner, wake=wake, faults=faults)
        pull.start()
        return PullScheduler(block_size, pull.identity, kv.lease_s), pull
    from disagg.kv.push import PushScheduler, PushWorker

    push = PushWorker(config, runner, wake=wake, faults=faults)
    push.start()
    return PushScheduler(block_size, push.identity), push
