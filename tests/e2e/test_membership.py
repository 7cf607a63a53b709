"""End to end: live membership. A router started with no instances; instances that register
themselves (`disagg serve --router`) receive work; one killed outright stops receiving work and
leaves the list within 3 heartbeat intervals; one drained (SIGTERM) under load finishes every
request it holds, reports its pool full, and leaves.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.client import Answer, complete, completion_body, prompt_ids
from tests.e2e.cluster import HOST, Cluster, Proc
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5
TIMEOUT_S = 3 * HEARTBEAT_S  # the router drops an instance after 3 missed heartbeats
WAIT_S = 60.0


def start_router(cluster: Cluster, mode: str = "aggregated") -> Proc:
    """A router naming no instance: it answers 503 until every role has registered."""
    argv = ["route", "--host", HOST, "--port", "0", "--mode", mode]
    router = cluster._spawn(f"router-{mode}", [*argv, "--heartbeat-timeout-s", str(TIMEOUT_S)])
    wait_until(
        lambda: router.poll_ready() or bool(router.url), f"the {mode} router to listen", WAIT_S
    )
    assert router.get_status("/health") == 503
    return router


def registering(router: Proc) -> list[str]:
    """`disagg serve` flags that make an instance join `router` on its own."""
    return ["--router", router.url, "--heartbeat-s", str(HEARTBEAT_S)]


def start_load(router: Proc, seeds: range, max_tokens: int) -> tuple[ThreadPoolExecutor, list]:
    """One client per seed, all at once: (the pool, their futures of Answer)."""
    clients = ThreadPoolExecutor(len(seeds))
    return clients, [clients.submit(ask, router, s, max_tokens) for s in seeds]


def finish_load(clients: ThreadPoolExecutor, running: list, max_tokens: int) -> None:
    """Every client got a whole answer (a hung one fails the `result` wait)."""
    answers = [future.result(timeout=WAIT_S) for future in running]
    clients.shutdown()
    assert [a.status for a in answers] == [200] * len(answers), [a.body for a in answers]
    assert all(a.body["usage"]["completion_tokens"] == max_tokens for a in answers)


def start_instance(cluster: Cluster, name: str, router: Proc) -> Proc:
    instance = cluster.serve(name, args=registering(router))
    cluster.wait_ready(instance)
    wait_until(lambda: instance.url in listed(router), f"{name} to register", WAIT_S)
    return instance


def listed(router: Proc) -> dict[str, dict]:
    return {row["url"]: row for row in router.get_json("/instances")}


def ask(router: Proc, seed: int, max_tokens: int = 8) -> Answer:
    return complete(router.url, completion_body(prompt_ids(seed, 24), max_tokens))


def test_register_kill_and_drain(cluster: Cluster) -> None:
    router = start_router(cluster)
    first = start_instance(cluster, "first", router)
    wait_until(lambda: router.get_status("/health") == 200, "the router to take work", WAIT_S)
    assert ask(router, 1).status == 200
    assert first.num_finished("length") == 1
    assert listed(router)[first.url]["source"] == "registered"

    late = start_instance(cluster, "late", router)  # joins a router already serving
    wait_until(
        lambda: listed(router)[late.url]["healthy"], "the late instance to be probed", WAIT_S
    )
    for seed in range(2, 6):
        assert ask(router, seed).status == 200
    assert late.num_finished("length") >= 1, "the late instance never received work"

    late.kill()  # no deregistration: only the missed heartbeats tell the router
    killed_s = time.monotonic()
    wait_until(lambda: late.url not in listed(router), "the killed instance to go", WAIT_S)
    gone_after_s = time.monotonic() - killed_s
    assert gone_after_s <= 3 * HEARTBEAT_S + 1.0  # + one health poll and a scheduling slack
    served_before = first.num_finished("length")
    answers = [ask(router, seed) for seed in range(10, 14)]
    assert all(a.status == 200 for a in answers), [a.body for a in answers if a.status != 200]
    assert first.num_finished("length") == served_before + 4

    spare = start_instance(cluster, "spare", router)
    wait_until(
        lambda: listed(router)[spare.url]["healthy"], "the spare instance to be probed", WAIT_S
    )
    drain_under_load(cluster, router, first, spare)


def drain_under_load(cluster: Cluster, router: Proc, draining: Proc, staying: Proc) -> None:
    """SIGTERM `draining` while requests run on both: none is lost, its pool ends full."""
    clients, running = start_load(router, range(20, 26), max_tokens=400)
    wait_until(
        lambda: draining.load()["num_running"] > 0, "requests on the draining instance", WAIT_S
    )
    draining.popen.send_signal(signal.SIGTERM)
    wait_until(
        lambda: listed(router).get(draining.url, {}).get("draining", True), "draining shown", WAIT_S
    )
    during = ask(router, 30)  # new work goes to the instance that stays
    assert during.status == 200, during.body
    finish_load(clients, running, max_tokens=400)
    assert draining.popen.wait(WAIT_S) == 0
    log = draining.log_path.read_text()
    assert "disagg serve drained: 1024 of 1024 KV blocks free" in log, draining.log_tail()
    wait_until(lambda: draining.url not in listed(router), "the drained instance to leave", WAIT_S)
    assert staying.num_finished("length") >= 1


def test_a_prefill_instance_drains_mid_handoff_in_pull_mode(cluster: Cluster) -> None:
    """Pull: requests prefilled on P wait there for D's READ. A P told to stop keeps its KV
    until every D has read it: no request is lost or answered twice, and its pool ends full."""
    router = start_router(cluster, "pull")
    kv = {"connector": "pull", "transport": "tcp", "args": registering(router)}
    leaving = cluster.serve("p-leaving", role="prefill", **kv)
    staying = cluster.serve("p-staying", role="prefill", **kv)
    decode = cluster.serve("d-pull", role="decode", **kv)
    cluster.wait_ready(leaving, staying, decode)
    wait_until(lambda: router.get_status("/health") == 200, "the pull router to take work", WAIT_S)
    clients, running = start_load(router, range(40, 48), max_tokens=200)
    wait_until(lambda: leaving.num_finished("length") + leaving.load()["num_running"] > 0,
               "work on the prefill instance that leaves", WAIT_S)  # fmt: skip
    leaving.popen.send_signal(signal.SIGTERM)
    finish_load(clients, running, max_tokens=200)
    assert leaving.popen.wait(WAIT_S) == 0
    assert "disagg serve drained: 1024 of 1024 KV blocks free" in leaving.log_path.read_text()
    assert decode.load()["num_free_blocks"] == decode.load()["num_total_blocks"]
    assert staying.url in listed(router) and leaving.url not in listed(router)
