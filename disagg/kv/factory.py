"""Build the KV connector a deployment asks for (pull or push) around the runner's KV tensor."""

from __future__ import annotations

from typing import Any

from disagg.config import EngineConfig
from disagg.engine.kv_connector import KVConnector

__all__ = ["make_connector"]


def make_connector(config: EngineConfig, runner: Any, *, wake: Any = None) -> KVConnector:
    if config.kv_transfer.connector == "pull":
        from disagg.kv.pull import PullConnector

        return PullConnector(config, runner, wake=wake)
    from disagg.kv.push import PushConnector

    return PushConnector(config, runner, wake=wake)
