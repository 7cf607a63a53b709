"""End to end, real processes: bad input through the router of a pull cluster.

Every bad body an adversarial tester sent is answered with a 4xx in the OpenAI error shape
({"error": {"message", "type", "param", "code"}}), no instance dies or keeps a block, and a
normal request right after each one gets the aggregated reference text.
"""

from __future__ import annotations

import http.client
import json

import pytest

from tests.e2e.client import complete, completion_body, prompt_ids
from tests.e2e.cluster import Cluster, Proc, Reference, assert_pools_full

pytestmark = pytest.mark.slow

_OK = completion_body(prompt_ids(1, 24), 6)
_KV = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
       "remote_port": 1, "remote_block_ids": [0, 1], "first_token_id": 10**9}  # fmt: skip

# (id, method, path, raw body, expected status)
CASES: list[tuple[str, str, str, bytes, int]] = [
    ("not-json", "POST", "/v1/completions", b"{nope", 400),
    ("not-an-object", "POST", "/v1/completions", b"[1, 2]", 400),
    ("lone-surrogate", "POST", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', 400),
    ("deep-json", "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("temperature-1e309", "POST", "/v1/completions",
     b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e309}', 400),
    ("nan", "POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("client-kv-params", "POST", "/v1/completions",
     json.dumps({**_OK, "kv_transfer_params": _KV}).encode(), 400),
    ("negative-max-tokens", "POST", "/v1/completions",
     json.dumps({**_OK, "max_tokens": -1}).encode(), 400),
    ("top-p-zero", "POST", "/v1/completions", json.dumps({**_OK, "top_p": 0}).encode(), 400),
    ("n-2", "POST", "/v1/completions", json.dumps({**_OK, "n": 2}).encode(), 400),
    ("token-out-of-vocab", "POST", "/v1/completions",
     json.dumps({**_OK, "prompt": [5, 10**9]}).encode(), 400),
    ("over-the-context", "POST", "/v1/completions",
     json.dumps({**_OK, "max_tokens": 10**6}).encode(), 400),
    ("unknown-model", "POST", "/v1/completions",
     json.dumps({**_OK, "model": "nope"}).encode(), 404),
    ("empty-messages", "POST", "/v1/chat/completions", b'{"messages": []}', 400),
    ("unknown-path", "POST", "/v1/nothing", b"{}", 404),
    ("wrong-method", "GET", "/v1/completions", b"", 405),
    ("too-large", "POST", "/v1/completions", b'{"prompt": "' + b"a" * (17 << 20) + b'"}', 413),
]  # fmt: skip


@pytest.fixture(scope="module")
def pull(cluster: Cluster, aggregated: Proc) -> tuple[Proc, Proc, Proc]:
    prefill = cluster.serve("prefill", role="prefill", transport="tcp")
    decode = cluster.serve("decode", role="decode", transport="tcp")
    cluster.wait_ready(prefill, decode, aggregated)
    return prefill, decode, cluster.route("router", [prefill], [decode], mode="pull")


@pytest.mark.parametrize(("method", "path", "raw", "status"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_input_is_a_4xx_and_the_next_request_succeeds(
    pull: tuple[Proc, Proc, Proc], reference: Reference, method: str, path: str, raw: bytes,
    status: int,
) -> None:  # fmt: skip
    prefill, decode, router = pull
    got, body = _send(router.url, method, path, raw)
    assert got == status, body[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    answer = complete(router.url, _OK)
    assert answer.status == 200 and answer.text == reference(_OK)
    assert prefill.is_alive and decode.is_alive
    assert_pools_full(prefill, decode)


def test_tiny_temperature_is_served_greedy(pull: tuple[Proc, Proc, Proc], reference: Reference):
    """temperature 1e-38 killed the prefill instance's engine loop; it is greedy now."""
    _, _, router = pull
    answer = complete(router.url, {**_OK, "temperature": 1e-38})
    assert answer.status == 200 and answer.text == reference(_OK)


def _send(url: str, method: str, path: str, raw: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request(method, path, body=raw or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (ConnectionResetError, BrokenPipeError):
        # aiohttp may answer 413 and close before the whole body is sent: read what it said.
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
