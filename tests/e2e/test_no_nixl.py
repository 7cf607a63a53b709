"""End to end on a host without NIXL (hidden by modules that refuse to import): the default
`--kv-transport auto` falls back to TCP on both sides, a push pair behind the router answers,
and each instance reports the transport it resolved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.client import complete, completion_body, prompt_ids
from tests.e2e.cluster import Cluster
from tests.no_nixl import write_no_nixl_dir

pytestmark = pytest.mark.slow


def test_auto_transport_falls_back_to_tcp_and_serves(cluster: Cluster, tmp_path: Path) -> None:
    hidden = write_no_nixl_dir(tmp_path / "no-nixl")
    env = {"PYTHONPATH": os.pathsep.join([str(hidden), os.getcwd()])}
    prefill = cluster.serve("prefill", role="prefill", connector="push", transport="auto", env=env)
    decode = cluster.serve("decode", role="decode", connector="push", transport="auto", env=env)
    cluster.wait_ready()
    router = cluster.route("router", [prefill], [decode], mode="push")
    answer = complete(router.url, completion_body(prompt_ids(3, 48), 6))
    assert answer.status == 200, answer.body
    assert answer.body["usage"]["completion_tokens"] == 6
    for instance in (prefill, decode):
        info = instance.kv_info()
        assert info["transport"] == "tcp" and info["compat"]["transport"] == "tcp", info
    assert prefill.stats()["transfers"] + decode.stats()["transfers"] >= 1  # KV moved
