"""Pull, decode side: a READ is never posted once P's lease on the blocks may have run out
(regression: a late READ could copy blocks P had already reused for another request)."""

from __future__ import annotations

import asyncio
import ssl
import time
from concurrent.futures import Future

import numpy as np
import pytest

from disagg.config import SchedulerConfig
from disagg.engine.block_pool import BlockPool
from disagg.engine.kv_connector import KVConnectorMeta, KVSend
from disagg.engine.outputs import KVConnectorOutput
from disagg.engine.request import Request
from disagg.engine.scheduler import Scheduler
from disagg.kv.pull import PullScheduler, PullWorker
from disagg.protocol import KV_RELEASE_PATH, KVTransferParams, SamplingParams
from tests.kv.fakes import make_worker


def _connector(
    setup: str, policy: str = "fail", role: str = "decode"
) -> tuple[PullWorker, np.ndarray]:
    worker, buffer = make_worker(
        PullWorker, role=role, connector="pull", pull_setup=setup, failure_policy=policy
    )
    worker.start()  # as the factory does
    return worker, buffer


def _request(lease_s: float, age_s: float) -> Request:
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="p",
        remote_host="127.0.0.1",
        remote_port=1,
        remote_block_ids=[0, 1],
        remote_request_id="r",
        first_token_id=3,
        lease_s=lease_s,
    )
    return Request(
        request_id="r",
        prompt_token_ids=[1] * 6,
        sampling=SamplingParams(),
        arrival_s=time.monotonic() - age_s,
        kv_transfer_params=params,
    )


def _receive(worker: PullWorker, request: Request) -> None:
    """The scheduler half reserves blocks 4, 5; the worker gets the receive in its meta."""
    scheduler_half = PullScheduler(4, worker.identity, lease_s=30.0)
    scheduler_half.on_blocks_allocated(request, [4, 5], 6)
    worker.start_load(scheduler_half.build_meta())


def _failed(connector: PullWorker) -> KVConnectorOutput:
    """get_finished() until a failure is reported (the background reader runs on its thread)."""
    deadline = time.monotonic() + 5.0
    while not (out := connector.get_finished()).failed:
        assert time.monotonic() < deadline, "no failure reported"
        time.sleep(0.005)
    return out


@pytest.mark.parametrize("setup", ["inline", "background"])
def test_read_after_the_lease_fails_without_posting(setup: str) -> None:
    connector, _ = _connector(setup)
    try:
        ready: Future[str] = Future()
        ready.set_result("p")
        connector._peers["p"] = ready  # the handshake happened long ago
        request = _request(lease_s=2.0, age_s=5.0)  # arrived 5 s ago: the lease has run out
        _receive(connector, request)
        out = _failed(connector)
        assert "lease" in out.failed["r"].reason and not connector.reader.blocks_in_use()
    finally:
        connector.close()


@pytest.mark.parametrize("setup", ["inline", "background"])
def test_read_within_the_lease_is_posted(setup: str) -> None:
    connector, _ = _connector(setup)
    try:
        ready: Future[str] = Future()
        ready.set_result("missing-peer")  # posting to an unknown peer fails in the transport
        connector._peers["p"] = ready
        _receive(connector, _request(lease_s=30.0, age_s=0.0))
        out = _failed(connector)
        assert "lease" not in out.failed["r"].reason  # it got as far as the transport
    finally:
        connector.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_read_carries_the_deployments_policy(policy: str) -> None:
    """The worker says what the scheduler must do with a failed handoff, as a typed field:
    policy recompute -> KVFailure.recompute (the scheduler prefills locally), never a string."""
    connector, _ = _connector("background", policy)
    try:
        ready: Future[str] = Future()
        ready.set_result("missing-peer")
        connector._peers["p"] = ready
        _receive(connector, _request(lease_s=30.0, age_s=0.0))
        failure = _failed(connector).failed["r"]
        assert failure.recompute is (policy == "recompute")
    finally:
        connector.close()


def test_a_release_that_overtakes_its_lease_ends_the_lease_at_once() -> None:
    """Prefill side. Regression: the router releases a lease as soon as its client leaves
    during the P leg, which can be while P's loop is still in the step that finishes the
    prefill; the release found no lease, and the lease made a moment later held its blocks
    until it expired (30 s by default)."""
    connector, _ = _connector("background", role="prefill")
    try:
        release = connector.side_channel()[KV_RELEASE_PATH]
        asyncio.run(release({"request_id": "r#1"}))  # (1) before the lease exists
        send = KVSend("r#1", (0, 1), 3, KVTransferParams(do_remote_decode=True))
        connector.start_load(KVConnectorMeta(sends=[send]))  # (2) the finished prefill
        assert connector.get_finished().finished_sending == {"r#1"}  # freed in this step
        assert not connector.blocks_in_use() and not connector.has_pending()
    finally:
        connector.close()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_decode_request_aborted_before_its_read_releases_the_prefill_lease(scheme: str) -> None:
    """Decode side. Regression: a request aborted while it still waited for blocks or a seat
    (its client left at once) never had a READ set up and told P nothing: P held the prompt's
    blocks until the lease expired (found by hanging up clients at the handoff). Under internal
    TLS the release goes over https, as every side-channel call (regression: it went to
    http:// and failed quietly, so P waited for the lease)."""
    connector, _ = _connector("background")
    if scheme == "https":
        connector.side_tls = ssl.create_default_context()  # what --internal-tls-ca sets
    posted: list[tuple[str, dict[str, object]]] = []
    connector._post_quietly = lambda url, body: posted.append((url, body))  # type: ignore[method-assign]
    try:
        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
            BlockPool(8),
            4,
            connector=PullScheduler(4, connector.identity, lease_s=30.0),
        )
        scheduler.add_request(_request(lease_s=30.0, age_s=0.0))
        assert scheduler.abort("r", time.monotonic())  # (1) before it was ever scheduled
        connector.start_load(scheduler.take_kv_meta())  # (2) what the engine hands the worker
        deadline = time.monotonic() + 5.0
        while not posted:
            assert time.monotonic() < deadline, "P was never told"
            time.sleep(0.005)
        assert posted == [(f"{scheme}://127.0.0.1:1{KV_RELEASE_PATH}", {"request_id": "r"})]
    finally:
        connector.close()
