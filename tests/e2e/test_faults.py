"""End to end, real processes: injected transfer failures, killed peers, expired leases and
reservations, for pull and push.

Proves that every fault answers the client within a bound (an error that names the cause, or
under policy recompute the aggregated output) and leaves no block held on any surviving
instance. Kills are SIGKILL: the peer vanishes without a word, as in a crash.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from disagg.kv.faults import KVFaults
from disagg.protocol import KVTransferParams
from disagg.router.call import prefill_body, push_params
from tests.e2e.client import (
    Answer,
    complete,
    completion_body,
    open_stream,
    prompt_ids,
    read_chunks,
    stream,
)
from tests.e2e.cluster import Cluster, Proc, Reference, assert_pools_full
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

TRANSPORTS = ["nixl", "tcp"]
CLIENT_TIMEOUT_S = 30.0  # a client waiting longer than this calls it a hang
PROMPT_S = 10.0  # "promptly": a fault answered within this
LEASE_S = 2.0  # P's lease on blocks nobody reads
RESERVATION_S = 3.0  # D's deadline for a write that never comes
# A prompt that P prefills in 16-token chunks takes a few hundred engine steps: long enough to
# see a request mid-prefill and kill a peer then.
SLOW_PREFILL_ARGS = ("--max-num-batched-tokens", "16")
LONG_PROMPT_TOKENS = 3000
FAIL_TRANSFERS = KVFaults(fail_transfer=True).as_env()  # a faulty instance's environment


# ---- fixtures --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Faulty:
    """A prefill instance and two decode instances of a mode (policy fail and recompute), each
    pair behind a router, and optionally plain decode instances for a test to kill."""

    prefill: Proc
    decode_fail: Proc  # policy fail
    decode_recompute: Proc  # policy recompute
    to_fail: Proc  # router: prefill -> decode_fail
    to_recompute: Proc  # router: prefill -> decode_recompute
    victims: tuple[Proc, ...]  # plain decode instances that tests kill

    @property
    def instances(self) -> tuple[Proc, Proc, Proc]:
        return self.prefill, self.decode_fail, self.decode_recompute


def _start_faulty(
    cluster: Cluster,
    mode: str,
    prefill_args: list[str],
    decode_args: list[str],
    num_victims: int = 0,
    *,
    faulty: str,
) -> Faulty:
    """`faulty` ("prefill" or "decode") names the side whose transfers all fail."""
    prefill_env, decode_env = (
        (FAIL_TRANSFERS, None) if faulty == "prefill" else (None, FAIL_TRANSFERS)
    )
    prefill = cluster.serve(
        f"prefill-{mode}", role="prefill", connector=mode, args=prefill_args, env=prefill_env
    )
    fail = cluster.serve(
        f"decode-{mode}-fail", role="decode", connector=mode, args=decode_args, env=decode_env
    )
    recompute = cluster.serve(
        f"decode-{mode}-recompute",
        role="decode",
        connector=mode,
        args=[*decode_args, "--failure-policy", "recompute"],
        env=decode_env,
    )
    victims = tuple(
        cluster.serve(f"decode-{mode}-victim", role="decode", connector=mode)
        for _ in range(num_victims)
    )
    cluster.wait_ready()
    to_fail = cluster.route(f"router-{mode}-fail", [prefill], [fail], mode=mode)
    to_recompute = cluster.route(f"router-{mode}-recompute", [prefill], [recompute], mode=mode)
    return Faulty(prefill, fail, recompute, to_fail, to_recompute, victims)


@pytest.fixture(scope="class")
def pull(cluster: Cluster, aggregated: Proc) -> Iterator[Faulty]:
    """Pull: P leases blocks for 2 s; two decode instances fail every READ they start, a third
    (plain) is there to be killed."""
    faulty = _start_faulty(cluster, "pull", ["--lease-s", str(LEASE_S)], [], 1, faulty="decode")
    yield faulty
    cluster.stop(faulty.to_fail, faulty.to_recompute, *faulty.instances, *faulty.victims)


@pytest.fixture(scope="class")
def push(cluster: Cluster, aggregated: Proc) -> Iterator[Faulty]:
    """Push: P fails every WRITE it starts; decode reservations expire after 3 s."""
    faulty = _start_faulty(
        cluster, "push", [], ["--reservation-timeout-s", str(RESERVATION_S)], faulty="prefill"
    )
    yield faulty
    cluster.stop(faulty.to_fail, faulty.to_recompute, *faulty.instances, *faulty.victims)


# ---- pull ------------------------------------------------------------------------------------


class TestPull:
    def test_failed_read_fails_request(self, pull: Faulty):
        """Policy fail: D's READ fails (fault) -> the client gets HTTP 500 naming the failure,
        streamed or not; D counts the failure; no block is held on P or D."""
        _assert_fault_fails_requests(pull, pull.decode_fail, 1, "injected transfer failure")

    def test_failed_read_recomputes(self, pull: Faulty, reference: Reference):
        """Policy recompute: D's READ fails -> D prefills locally: the aggregated output, no
        transfer in its breakdown. D tells P it gave up, so P frees its blocks at once rather
        than when the lease expires (regression: P held them for the whole lease)."""
        body = _body(3)
        before = pull.prefill.stats()["expired_leases"]
        answer = complete(pull.to_recompute.url, body, timeout_s=CLIENT_TIMEOUT_S)
        assert answer.status == 200, answer.body
        assert answer.text == reference(body)
        assert "transfer_s" not in answer.body["disagg"]["breakdown"]
        assert_pools_full(*pull.instances, timeout_s=LEASE_S / 2)
        assert pull.prefill.stats()["expired_leases"] == before

    def test_lease_frees_blocks_nobody_reads(self, pull: Faulty):
        """D died after P answered and no abort reaches P (the router died too): P's blocks are
        held, then freed when the 2 s lease expires (expired_leases +1)."""
        before = pull.prefill.stats()["expired_leases"]
        answer = _prefill_leg(
            pull.prefill, _body(4), KVTransferParams(do_remote_decode=True, connector="pull")
        )
        assert answer.status == 200, answer.body
        assert pull.prefill.load()["num_free_blocks"] < pull.prefill.load()["num_total_blocks"]
        assert_pools_full(pull.prefill, timeout_s=LEASE_S + 5)
        assert pull.prefill.stats()["expired_leases"] == before + 1

    def test_decode_killed_mid_stream(self, pull: Faulty, cluster: Cluster):
        """D is killed while it streams: the client's stream ends promptly with an error event
        naming the decode instance, and P holds no block."""
        victim = pull.victims[0]
        router = cluster.route("router-pull-victim", [pull.prefill], [victim], mode="pull")
        try:
            opened = open_stream(router.url, _body(5, max_tokens=3000), timeout_s=CLIENT_TIMEOUT_S)
            read_chunks(opened, 2)
            killed_s = time.monotonic()
            victim.kill()
            events = list(opened.events())
            assert time.monotonic() - killed_s < PROMPT_S
            errors = [e["error"]["message"] for e in events if isinstance(e, dict) and "error" in e]
            assert errors and "decode instance" in errors[0], events[-3:]
            assert_pools_full(pull.prefill)
        finally:
            cluster.stop(router)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_prefill_killed_after_answering(cluster: Cluster, transport: str):
    """Pull: P answers (blocks leased), then is killed before D reads. D already knows P (an
    earlier request went through), so D's READ itself fails: the client gets an error naming
    the failed read within seconds, and D holds no block."""
    prefill = cluster.serve(f"prefill-pull-victim-{transport}", role="prefill", transport=transport)
    decode = cluster.serve(
        f"decode-pull-{transport}",
        role="decode",
        transport=transport,
        args=["--transfer-timeout-s", "3"],
    )
    cluster.wait_ready(prefill, decode)
    router = cluster.route(f"router-pull-{transport}", [prefill], [decode], mode="pull")
    try:
        assert complete(router.url, _body(10)).status == 200  # handshake done, peer known
        answer = _prefill_leg(
            prefill, _body(11), KVTransferParams(do_remote_decode=True, connector="pull")
        )
        prefill.kill()
        decoded = _decode_leg(decode, _body(11), answer.body["kv_transfer_params"])
        _assert_failed(decoded, "KV read")  # failed, or timed out after D's 3 s
        assert decoded.elapsed_s < PROMPT_S
        assert_pools_full(decode)
    finally:
        cluster.stop(router, prefill, decode)


# ---- push ------------------------------------------------------------------------------------


class TestPush:
    def test_failed_write_fails_request(self, push: Faulty):
        """Policy fail: P's WRITE fails (fault) and P tells D (write_failed) -> the client gets
        HTTP 500 naming the failure, streamed or not; no block is held on P or D."""
        message = "could not write the KV: injected transfer failure"
        _assert_fault_fails_requests(push, push.prefill, 20, message)

    def test_failed_write_recomputes(self, push: Faulty, reference: Reference):
        """Policy recompute on D: P's WRITE fails, D gets write_failed and prefills locally:
        the aggregated output, no transfer in its breakdown, every pool full."""
        body = _body(22)
        answer = complete(push.to_recompute.url, body, timeout_s=CLIENT_TIMEOUT_S)
        assert answer.status == 200, answer.body
        assert answer.text == reference(body)
        assert "transfer_s" not in answer.body["disagg"]["breakdown"]
        assert_pools_full(*push.instances)

    def test_reservation_expires_without_prefill(self, push: Faulty):
        """D reserves blocks for a push P never prefills (its leg was lost): after 3 s D fails
        the request naming the deadline (expired_reservations +1), cancels its registration on
        P, and neither holds a block or a registration."""
        before = push.decode_fail.stats()["expired_reservations"]
        _, d_body = _push_legs(push.prefill, _body(23))
        answer = complete(push.decode_fail.url, d_body, timeout_s=CLIENT_TIMEOUT_S, signed=True)
        _assert_failed(answer, f"within {RESERVATION_S}s")
        assert RESERVATION_S <= answer.elapsed_s < RESERVATION_S + PROMPT_S
        assert push.decode_fail.stats()["expired_reservations"] == before + 1
        assert_pools_full(push.prefill, push.decode_fail)
        wait_until(lambda: not push.prefill.kv_info()["pending"]["registrations"], "P drops it")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_prefill_killed_while_decode_reserves(cluster: Cluster, transport: str):
    """Push: P is killed mid-prefill while D holds a reservation for its write: the client gets
    an error naming the prefill instance promptly, and D's pool is full with nothing pending."""
    prefill = cluster.serve(
        f"prefill-push-victim-{transport}",
        role="prefill",
        connector="push",
        transport=transport,
        args=SLOW_PREFILL_ARGS,
    )
    decode = cluster.serve(
        f"decode-push-{transport}",
        role="decode",
        connector="push",
        transport=transport,
        args=["--reservation-timeout-s", str(RESERVATION_S)],
    )
    cluster.wait_ready(prefill, decode)
    router = cluster.route(f"router-push-{transport}", [prefill], [decode], mode="push")
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(complete, router.url, _long_body(30), timeout_s=CLIENT_TIMEOUT_S)
            wait_until(
                lambda: decode.kv_info()["pending"]["reservations"] and _is_prefilling(prefill),
                "D holds a reservation while P prefills",
            )
            answer = _answer_after_kill(prefill, pending)
        _assert_failed(answer, "prefill instance")
        assert_pools_full(decode, timeout_s=RESERVATION_S + 5)
        assert not any(decode.kv_info()["pending"].values())
    finally:
        cluster.stop(router, prefill, decode)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_decode_killed_while_prefill_holds_blocks(cluster: Cluster, transport: str):
    """Push, legs sent straight to the instances (no router to abort anything): D registers,
    then is killed while P is mid-prefill. P still answers its leg, its WRITE into the dead D
    fails (transfers_failed +1), and P frees every block and keeps nothing pending."""
    prefill = cluster.serve(
        f"prefill-push-{transport}",
        role="prefill",
        connector="push",
        transport=transport,
        # A lease longer than the prefill: P must find the dead D by its failed write.
        args=[*SLOW_PREFILL_ARGS, "--lease-s", "30"],
    )
    decode = cluster.serve(
        f"decode-push-victim-{transport}", role="decode", connector="push", transport=transport
    )
    cluster.wait_ready(prefill, decode)
    try:
        p_body, d_body = _push_legs(prefill, _long_body(40))
        with ThreadPoolExecutor(2) as pool:
            p_leg = pool.submit(
                complete, prefill.url, p_body, timeout_s=CLIENT_TIMEOUT_S, signed=True
            )
            pool.submit(complete, decode.url, d_body, timeout_s=CLIENT_TIMEOUT_S, signed=True)
            wait_until(
                lambda: prefill.kv_info()["pending"]["registrations"] and _is_prefilling(prefill),
                "D registered while P prefills",
            )
            decode.kill()
            answer = p_leg.result(CLIENT_TIMEOUT_S)
        assert answer.status == 200 and answer.body["kv_transfer_params"], answer.body
        assert_pools_full(prefill)
        wait_until(lambda: not any(prefill.kv_info()["pending"].values()), "P has nothing pending")
        assert prefill.stats()["transfers_failed"] == 1
    finally:
        cluster.stop(prefill, decode)


# ---- helpers ---------------------------------------------------------------------------------


def _body(seed: int, *, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return completion_body(prompt_ids(seed, 24 + seed % 40), max_tokens, **extra)


def _long_body(seed: int) -> dict[str, Any]:
    return completion_body(prompt_ids(seed, LONG_PROMPT_TOKENS), 4)


def _prefill_leg(prefill: Proc, body: dict[str, Any], params: KVTransferParams) -> Answer:
    """The P leg exactly as the router sends it (max_tokens 1, KV kept for a decode instance)."""
    return complete(
        prefill.url, prefill_body(body, params), timeout_s=CLIENT_TIMEOUT_S, signed=True
    )


def _decode_leg(decode: Proc, body: dict[str, Any], params: dict[str, Any]) -> Answer:
    body = {**body, "kv_transfer_params": params}
    return complete(decode.url, body, timeout_s=CLIENT_TIMEOUT_S, signed=True)


def _push_legs(prefill: Proc, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P leg body, D leg body) of one push dispatch, keyed by a fresh transfer id."""
    info = prefill.kv_info()
    p_params, d_params = push_params(
        uuid.uuid4().hex, info["engine_id"], info["kv_host"], info["kv_port"], None
    )
    return prefill_body(body, p_params), {**body, "kv_transfer_params": d_params.to_sparse_dict()}


def _assert_failed(answer: Answer, reason: str) -> None:
    assert answer.status >= 400, answer.body
    assert reason in answer.error_message, answer.error_message


def _assert_fault_fails_requests(faulty: Faulty, counter: Proc, seed: int, reason: str) -> None:
    """Policy fail: a plain and a streamed request through `faulty.to_fail` (bodies `seed` and
    `seed + 1`) fail naming `reason`, `counter` counts both failed transfers, and no block is
    held on P or D."""
    before = counter.stats()["transfers_failed"]
    url = faulty.to_fail.url
    answer = complete(url, _body(seed), timeout_s=CLIENT_TIMEOUT_S)
    streamed = stream(url, _body(seed + 1, stream=True), timeout_s=CLIENT_TIMEOUT_S)
    _assert_failed(answer, reason)
    assert streamed.status == 500 and "injected transfer failure" in str(streamed.error)
    assert counter.stats()["transfers_failed"] == before + 2
    assert_pools_full(faulty.prefill, faulty.decode_fail)


def _is_prefilling(prefill: Proc) -> bool:
    load = prefill.load()
    return load["num_running"] == 1 and load["num_queued_prefill_tokens"] > 0


def _answer_after_kill(victim: Proc, pending: Future[Answer]) -> Answer:
    """SIGKILL `victim`, then the client's answer, which must come within PROMPT_S."""
    killed_s = time.monotonic()
    victim.kill()
    answer = pending.result(CLIENT_TIMEOUT_S)
    assert time.monotonic() - killed_s < PROMPT_S, f"answered {time.monotonic() - killed_s}s late"
    return answer
