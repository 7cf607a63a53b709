"""End to end, real processes: each attack an adversarial tester ran against a cluster, as a
test. One request must never kill an instance, no client may touch another client's KV, and
no wrong token may be served with HTTP 200.

Instances run over the TCP transport (tests/security/test_tcp_transport_auth.py covers its
peer authentication); every child holds the cluster token tests.e2e.client.CLUSTER_TOKEN.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from disagg.kv.faults import KVFaults
from disagg.router.call import push_params
from disagg.security import auth
from tests.e2e.client import CLUSTER_TOKEN, complete, completion_body, prompt_ids
from tests.e2e.cluster import Cluster, Proc, Reference, assert_pools_full
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

API_KEY = "sk-attack-tests"
RESERVATION_S = 1.5  # D gives up on a push write after this...
REGISTER_DELAY_S = 3.0  # ...and its registration reaches P only after this (a slow D)


@dataclass(frozen=True, slots=True)
class Target:
    aggregated: Proc  # role both, behind --api-key
    push_prefill: Proc
    push_decode: Proc
    pull_prefill: Proc
    pull_decode: Proc
    slow_decode: Proc  # push, registers after its reservation expired
    push_router: Proc  # behind --api-key
    pull_router: Proc
    slow_router: Proc  # push_prefill -> slow_decode

    @property
    def instances(self) -> tuple[Proc, ...]:
        return (self.aggregated, self.push_prefill, self.push_decode, self.pull_prefill,
                self.pull_decode, self.slow_decode)  # fmt: skip


@pytest.fixture(scope="module")
def target(cluster: Cluster) -> Target:
    def serve(
        name: str, role: str, connector: str = "pull", *args: str, env: dict[str, str] | None = None
    ) -> Proc:
        return cluster.serve(
            name, role=role, connector=connector, transport="tcp", args=args, env=env
        )

    aggregated = serve("aggregated", "both", "pull", "--api-key", API_KEY)
    push_p, push_d = serve("push-p", "prefill", "push"), serve("push-d", "decode", "push")
    pull_p, pull_d = serve("pull-p", "prefill"), serve("pull-d", "decode")
    slow_env = KVFaults(register_delay_s=REGISTER_DELAY_S).as_env()  # it registers late
    slow_d = serve("slow-d", "decode", "push", "--reservation-timeout-s", str(RESERVATION_S),
                   env=slow_env)  # fmt: skip
    cluster.wait_ready()
    routers = (
        cluster.route("push-router", [push_p], [push_d], mode="push", args=["--api-key", API_KEY]),
        cluster.route("pull-router", [pull_p], [pull_d], mode="pull"),
        cluster.route("slow-router", [push_p], [slow_d], mode="push"),
    )
    return Target(aggregated, push_p, push_d, pull_p, pull_d, slow_d, *routers)


@pytest.fixture(scope="module")
def reference(target: Target, cluster: Cluster) -> Reference:
    return Reference(cluster, target.aggregated, headers=_bearer())


# ---- one request must not kill an instance ---------------------------------------------------


def test_tiny_temperature_is_greedy_not_a_dead_engine(target: Target, reference: Reference):
    """`temperature: 1e-38` used to make the sampler divide logits into inf/NaN and kill the
    prefill instance's engine loop (503 until restart). It is greedy now, on every leg."""
    body = completion_body(prompt_ids(1, 30), 8)
    answer = complete(target.pull_router.url, {**body, "temperature": 1e-38})
    assert answer.status == 200 and answer.text == reference(body)
    _assert_alive(target)


def test_remote_prefill_params_on_an_aggregated_instance_are_refused(target: Target):
    """`do_remote_prefill` sent to a role-both instance tripped a scheduler assertion and killed
    its engine for good. Unsigned it is refused as not the router's (403); even signed it is
    refused as the wrong role (400), and the instance serves the next request."""
    body = {**completion_body(prompt_ids(2, 20), 4), "kv_transfer_params": _remote_prefill()}
    assert _post(target.aggregated, body, bearer=True).status_code == 403
    refused = _post(target.aggregated, body, bearer=True, signed=True)
    assert refused.status_code == 400 and "decode instance" in _message(refused)
    _assert_alive(target)


def test_first_token_id_out_of_the_vocabulary_is_refused(target: Target):
    """A `first_token_id` of 10^9 sent to a decode instance indexed past the embedding and
    killed it (IndexError). Now a 400 naming the field, and D lives."""
    params = {**_remote_prefill(), "first_token_id": 10**9}
    body = {**completion_body(prompt_ids(3, 20), 4), "kv_transfer_params": params}
    refused = _post(target.pull_decode, body, signed=True)
    assert refused.status_code == 400 and "first_token_id" in _message(refused)
    _assert_alive(target)


# ---- nobody but the router sets kv_transfer_params -------------------------------------------


def test_client_kv_transfer_params_are_refused_by_the_router(target: Target):
    """Only the router may name blocks and peers: a client's `kv_transfer_params` is a 400."""
    body = {**completion_body(prompt_ids(4, 20), 4), "kv_transfer_params": _remote_prefill()}
    answer = complete(target.pull_router.url, body)
    assert answer.status == 400 and answer.body["error"]["param"] == "kv_transfer_params"


def test_reading_another_clients_kv_from_decode_is_refused(target: Target, reference: Reference):
    """Pull: a request sent straight to D naming P's cached block ids used to read them out
    (another client's continuation). Without the cluster signature D refuses the params."""
    victim = completion_body(prompt_ids(5, 40), 8)
    leg = _post(target.pull_prefill, {**victim, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}}, signed=True)  # fmt: skip
    assert leg.status_code == 200
    stolen = {
        **completion_body(prompt_ids(6, 40), 8),
        "kv_transfer_params": leg.json()["kv_transfer_params"],
    }  # noqa: E501
    answer = _post(target.pull_decode, stolen)
    assert answer.status_code == 403, answer.text
    assert_pools_full(target.pull_decode)


def test_forged_register_and_handshake_are_refused(target: Target, reference: Reference):
    """A forged /kv/register made P overwrite another client's blocks on D; a forged
    /kv/handshake dropped D as P's peer (or shifted its region: wrong text with 200). Both
    need the cluster signature now; a wrong token is refused too, and push still serves
    correct text afterwards."""
    register = {"transfer_id": "t", "engine_id": "evil", "block_ids": [0, 1], "ttl_s": 30}
    handshake = {"engine_id": "evil", "role": "decode", "compat": {}, "metadata": ""}
    for path, body in (("/kv/register", register), ("/kv/handshake", handshake),
                       ("/kv/cancel", {"transfer_id": "t"})):  # fmt: skip
        assert _post(target.push_prefill, body, path=path).status_code == 401
        forged = _post(target.push_prefill, body, path=path, token="x" * 32)
        assert forged.status_code == 401 and "signature" in _message(forged)
    body = completion_body(prompt_ids(7, 50), 8)
    answer = complete(target.push_router.url, body, headers=_bearer())
    assert answer.status == 200 and answer.text == reference(body)


def test_a_registration_from_another_decode_instance_is_never_written(target: Target):
    """Even a cluster member cannot redirect a push: P writes only into blocks registered by
    the decode instance the router named in P's leg (registrations_refused +1)."""
    prefill, decode = target.push_prefill, target.push_decode
    info, d_info = prefill.kv_info(), decode.kv_info()
    p_params, _ = push_params("tid-bound", info["engine_id"], info["kv_host"], info["kv_port"],
                              d_info["engine_id"])  # fmt: skip
    before = prefill.stats()["registrations_refused"]
    forged = {"transfer_id": "tid-bound", "engine_id": "decode-impostor", "block_ids": [0, 1],
              "ttl_s": 5}  # fmt: skip
    assert _post(prefill, forged, path="/kv/register", signed=True).status_code == 200
    leg = {**completion_body(prompt_ids(8, 20), 1), "kv_transfer_params": p_params.to_sparse_dict()}
    written = prefill.stats()["transfers"]
    headers = {"X-Request-Id": "bound-1"}
    assert _post(prefill, leg, signed=True, headers=headers).status_code == 200
    wait_until(lambda: prefill.stats()["registrations_refused"] == before + 1, "P drops it")
    assert prefill.stats()["transfers"] == written  # nothing went to the impostor
    _abort(prefill, "bound-1")  # the router would: frees the blocks P kept for the real D
    assert_pools_full(prefill)


def test_abort_needs_the_cluster_signature(target: Target, reference: Reference):
    """`/v1/abort` aborted any request whose id was known. Unsigned it is a 401 now, and the
    named request finishes with the right text."""
    body = completion_body(prompt_ids(9, 30), 64)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            requests.post, f"{target.aggregated.url}/v1/completions",
            json=body, headers={**_bearer(), "X-Request-Id": "victim-1"}, timeout=60,
        )  # fmt: skip
        time.sleep(0.2)
        assert (
            _post(target.aggregated, {"request_id": "victim-1"}, path="/v1/abort").status_code
            == 401
        )  # noqa: E501
        answer = pending.result(60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == reference(body)


def test_api_key_guards_the_openai_api(target: Target):
    """`--api-key` on the router and on an instance, as vLLM's: no key or a wrong one is a 401
    in the OpenAI error shape; /health stays open for probes."""
    body = completion_body(prompt_ids(10, 10), 2)
    for url in (target.push_router.url, target.aggregated.url):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
            assert refused.status_code == 401 and set(refused.json()["error"]) >= {
                "message",
                "type",
            }
        ok = requests.post(f"{url}/v1/completions", json=body, headers=_bearer(), timeout=30)
        assert ok.status_code == 200
        assert requests.get(f"{url}/health", timeout=5).status_code == 200


# ---- a failed handoff never leaks into another request's KV ----------------------------------


def test_late_write_after_a_failed_handoff_never_reaches_reused_blocks(
    target: Target, reference: Reference
):
    """The late-write race: D gave up on a push (reservation timeout) and freed its blocks in
    the same step, while its registration was still on its way to P; P then wrote into blocks
    D had handed to the next request (and its prefix cache): HTTP 200 with wrong text.

    Here D's registration reaches P only after D gave up. The victim fails with an error;
    requests D runs meanwhile on its own, and the same ones again (prefix-cache hits), are
    exactly the aggregated reference; every pool ends full."""
    prefill, decode = target.push_prefill, target.slow_decode
    info, d_info = prefill.kv_info(), decode.kv_info()
    p_params, d_params = push_params("tid-late", info["engine_id"], info["kv_host"],
                                     info["kv_port"], d_info["engine_id"])  # fmt: skip
    victim = completion_body(prompt_ids(11, 64), 4)
    bystanders = [completion_body(prompt_ids(12 + i % 2, 64), 48) for i in range(6)]
    # The legs straight to the instances: no router aborts P when D fails, so P still holds
    # the finished prefill when D's late registration arrives (as when an abort is lost).
    p_leg = {**victim, "max_tokens": 1, "kv_transfer_params": p_params.to_sparse_dict()}
    assert _post(prefill, p_leg, signed=True, headers={"X-Request-Id": "late-p"}).ok
    with ThreadPoolExecutor(1) as pool:
        d_leg = {**victim, "kv_transfer_params": d_params.to_sparse_dict()}
        pending = pool.submit(complete, decode.url, d_leg, signed=True)
        time.sleep(RESERVATION_S + 0.2)  # D has given up; its registration is still delayed
        deadline = time.monotonic() + REGISTER_DELAY_S + 1.0  # span the late registration
        answers = []
        while time.monotonic() < deadline:
            for body in bystanders:
                answers.append((body, complete(decode.url, body)))
        failed = pending.result(60)
    assert failed.status >= 400 and "within" in failed.error_message
    for body, answer in answers:
        assert answer.status == 200 and answer.text == reference(body), "wrong text served"
    _abort(prefill, "late-p")  # P never wrote: its finished prefill waits for the lease
    assert_pools_full(prefill, decode, timeout_s=30)


# ---- helpers ---------------------------------------------------------------------------------


def _remote_prefill() -> dict[str, Any]:
    return {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
            "remote_port": 1, "remote_block_ids": [0, 1, 2]}  # fmt: skip


def _bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _post(
    proc: Proc,
    body: dict[str, Any],
    *,
    path: str = "/v1/completions",
    signed: bool = False,
    token: str | None = None,
    bearer: bool = False,
    headers: dict[str, str] | None = None,
) -> requests.Response:
    data = json.dumps(body).encode()
    headers = {
        "Content-Type": "application/json",
        **(_bearer() if bearer else {}),
        **(headers or {}),
    }
    url = f"{proc.url}{path}"
    if signed or token:
        signature = auth.sign(token or CLUSTER_TOKEN, "POST", url, data,
                              request_id=headers.get("X-Request-Id", ""))  # fmt: skip
        headers[auth.SIGNATURE_HEADER] = signature.header
    return requests.post(url, data=data, headers=headers, timeout=60)


def _abort(proc: Proc, request_id: str) -> None:
    answer = _post(proc, {"request_id": request_id}, path="/v1/abort", signed=True)
    assert answer.status_code == 200


def _message(response: requests.Response) -> str:
    return str(response.json()["error"]["message"])


def _assert_alive(target: Target) -> None:
    for proc in target.instances:
        assert proc.is_alive and proc.get_status("/health") == 200, proc.describe()
    assert_pools_full(*target.instances, timeout_s=30)
