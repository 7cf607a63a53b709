"""End to end, real processes: what the router and the connectors do when a peer fails.

- Policy recompute: a request whose prefill instance is killed mid-prefill is answered by a
  decode instance that prefills it itself (the aggregated text, HTTP 200), for pull and push.
- Pull refuses (503) before prefilling when no decode instance is healthy: P holds nothing.
- Push registrations run side by side: one slow registration holds up no other.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.kv.faults import KVFaults
from tests.e2e.client import complete, completion_body, prompt_ids, run_all
from tests.e2e.cluster import Cluster, Reference, assert_pools_full
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

SLOW_PREFILL_ARGS = ("--max-num-batched-tokens", "16")  # a long prompt spans many steps
REGISTER_DELAY_S = 2.0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_recompute_answers_when_the_prefill_instance_dies(
    cluster: Cluster, reference: Reference, mode: str
) -> None:
    """P is SIGKILLed mid-prefill; under recompute the router sends the request whole to D,
    which prefills it: the client gets the aggregated text, and D's pool ends full."""
    prefill = cluster.serve(f"p-{mode}", role="prefill", connector=mode, transport="tcp",
                            args=SLOW_PREFILL_ARGS)  # fmt: skip
    decode_args = ["--failure-policy", "recompute", "--reservation-timeout-s", "5"]
    decode = cluster.serve(f"d-{mode}", role="decode", connector=mode, transport="tcp",
                           args=decode_args)  # fmt: skip
    cluster.wait_ready(prefill, decode)
    router = cluster.route(f"r-{mode}", [prefill], [decode], mode=mode,
                           args=["--failure-policy", "recompute"])  # fmt: skip
    body = completion_body(prompt_ids(100, 1500), 6)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(complete, router.url, body, timeout_s=60)
            wait_until(lambda: prefill.load()["num_queued_prefill_tokens"] > 0, "P prefills")
            prefill.kill()
            answer = pending.result(60)
        assert answer.status == 200 and answer.text == reference(body)
        assert_pools_full(decode, timeout_s=15)
    finally:
        cluster.stop(router, prefill, decode)


def test_pull_refuses_before_prefilling_without_a_healthy_decode(cluster: Cluster) -> None:
    """With its only decode instance dead, a pull router answered only after P had prefilled
    and held the blocks for a lease. Now 503 at once, and P never sees the request."""
    prefill = cluster.serve("p-lonely", role="prefill", transport="tcp")
    decode = cluster.serve("d-doomed", role="decode", transport="tcp")
    cluster.wait_ready(prefill, decode)
    router = cluster.route("r-lonely", [prefill], [decode], mode="pull")
    try:
        decode.kill()
        wait_until(lambda: not router.get_json("/instances")[1]["healthy"], "router sees D down")
        answer = complete(router.url, completion_body(prompt_ids(101, 40), 4))
        assert answer.status == 503 and "decode" in answer.error_message
        assert prefill.num_finished("length") == 0  # no prefill ran
        assert_pools_full(prefill, timeout_s=1)
    finally:
        cluster.stop(router, prefill)


def test_a_slow_registration_holds_up_no_other(cluster: Cluster, reference: Reference) -> None:
    """Push registrations went through one FIFO thread: with each one slow, four concurrent
    requests took four delays. They run side by side now: all four in about one delay."""
    prefill = cluster.serve("p-fifo", role="prefill", connector="push", transport="tcp")
    decode = cluster.serve("d-slow", role="decode", connector="push", transport="tcp",
                           env=KVFaults(register_delay_s=REGISTER_DELAY_S).as_env())  # fmt: skip
    cluster.wait_ready(prefill, decode)
    router = cluster.route("r-fifo", [prefill], [decode], mode="push")
    bodies = [completion_body(prompt_ids(110 + i, 30), 4) for i in range(4)]
    try:
        started = time.monotonic()
        answers = run_all(lambda body: complete(router.url, body), bodies)
        elapsed_s = time.monotonic() - started
        for body, answer in zip(bodies, answers, strict=True):
            assert answer.status == 200 and answer.text == reference(body)
        assert elapsed_s < 2 * REGISTER_DELAY_S, f"registrations waited on each other: {elapsed_s}"
        assert_pools_full(prefill, decode)
    finally:
        cluster.stop(router, prefill, decode)
