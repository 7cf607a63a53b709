"""End to end: `disagg status --once --json` (a subprocess, as a script runs it) against a
real pull pair over TCP behind the router, then again with the decode instance stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.e2e.client import complete, completion_body, prompt_ids
from tests.e2e.cluster import Cluster

pytestmark = pytest.mark.slow

STATUS_TIMEOUT_S = 60.0


def run_status(router_url: str, *flags: str) -> tuple[int, str]:
    """`disagg status --router URL --once FLAGS`: exit code and stdout; no traceback allowed."""
    argv = [sys.executable, "-m", "disagg.cli", "status", "--router", router_url, "--once"]
    proc = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc.returncode, proc.stdout


def status_json(router_url: str) -> dict[str, Any]:
    returncode, out = run_status(router_url, "--json")
    assert returncode == 0, out
    return json.loads(out)


def test_status_once_json_names_both_instances_with_roles_and_blocks(cluster: Cluster):
    """(1) a pull pair + router serve one request; (2) the JSON names P and D with their
    roles, health, block totals as their /load reports them, D's handoff and the stages each
    ran; (3) with D stopped it is shown down, and the command still exits 0."""
    prefill = cluster.serve("prefill", role="prefill", connector="pull", transport="tcp")
    decode = cluster.serve("decode", role="decode", connector="pull", transport="tcp")
    cluster.wait_ready()
    router = cluster.route("router", [prefill], [decode], mode="pull")
    answer = complete(router.url, completion_body(prompt_ids(1, 40), 4))  # (1)
    assert answer.status == 200, answer.body

    doc = status_json(router.url)  # (2)
    by_url = {inst["url"]: inst for inst in doc["instances"]}
    assert set(by_url) == {prefill.url, decode.url}, doc
    p, d = by_url[prefill.url], by_url[decode.url]
    assert (p["role"], p["health"], p["connector"]) == ("prefill", "ok", "pull")
    assert (d["role"], d["health"], d["transport"]) == ("decode", "ok", "tcp")
    assert p["num_blocks_total"] == prefill.load()["num_total_blocks"] > 0
    assert d["num_blocks_total"] == decode.load()["num_total_blocks"] > 0
    assert d["num_handoffs"] == decode.stats()["transfers"] >= 1
    assert d["num_kv_failures"] == 0
    assert {"queue", "prefill"} <= p["stage_means_s"].keys()
    assert "transfer" in d["stage_means_s"]
    assert doc["router"]["health"] == "ok" and doc["router"]["num_ok"] >= 1
    print(run_status(router.url)[1])  # the table, for whoever runs this with -s

    cluster.stop(decode)  # (3)
    doc = status_json(router.url)
    by_url = {inst["url"]: inst for inst in doc["instances"]}
    assert by_url[decode.url]["health"] == "down"
    assert by_url[decode.url]["num_blocks_total"] is None
    assert by_url[prefill.url]["health"] == "ok"
