"""Build the two halves of the KV connector a deployment asks for (pull or push) around the
runner's KV tensor: the pure scheduler half for the Scheduler, the worker half for the Engine."""

from __future__ import annotations

from typing import Any

from disagg.config import EngineConfig
from disagg.engine.kv_connector import KVConnectorScheduler, KVConnectorWorker

__all__ = ["make_connector"]


def make_connector(
    config: EngineConfig, runner: Any, *, wake: Any = None
) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    block_size = config.cache.block_size
    if config.kv_transfer.connector == "pull":
        from disagg.kv.pull import PullScheduler, PullWorker

        pull = PullWorker(config, runner, wake=wake)
        return PullScheduler(block_size, pull.identity, config.kv_transfer.lease_s), pull
    from disagg.kv.push import PushScheduler, PushWorker

    push = PushWorker(config, runner, wake=wake)
    return PushScheduler(block_size, push.identity), push
