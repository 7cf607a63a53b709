"""The live aiohttp app over a ScriptedEngine: OpenAI client round-trips, streaming, stop strings,
kv_transfer_params, errors, disconnects and the instance endpoints."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from disagg.protocol import KVTransferParams
from disagg.security import auth
from disagg.server.engine_client import EngineOverloadedError
from disagg.server.tokenizer import Tokenizer
from tests.helpers import wait_until
from tests.server.conftest import CLUSTER_TOKEN, OUTPUT_TEXT
from tests.server.fakes import ScriptedEngine, ServerThread

Serve = Callable[..., tuple[ScriptedEngine, ServerThread]]


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)


def _post(
    server: ServerThread, path: str, body: Any, *, signed: bool = False, **kwargs: Any
) -> requests.Response:
    """POST; `signed` makes it a cluster call, as the router sends legs and aborts."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    url = f"{server.url}{path}"
    if signed:
        request_id = kwargs.get("headers", {}).get("X-Request-Id", "")
        signature = auth.sign(CLUSTER_TOKEN, "POST", url, data, request_id=request_id)
        kwargs["headers"] = {**kwargs.get("headers", {}), auth.SIGNATURE_HEADER: signature.header}
    return requests.post(url, data=data, timeout=10, **kwargs)


def _sse(response: requests.Response) -> list[Any]:
    """Parsed `data:` payloads of an SSE body ([DONE] kept as the string)."""
    events = [e for e in response.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def test_completion_with_openai_client(serve: Serve, tokenizer: Tokenizer) -> None:
    engine, server = serve()
    out = _client(server).completions.create(model="fake-model", prompt="Paris is", max_tokens=50)
    assert out.choices[0].text == OUTPUT_TEXT
    assert out.choices[0].finish_reason == "stop"
    num_prompt = len(tokenizer.encode("Paris is"))
    num_out = len(engine.output_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt, num_out)
    assert out.usage.total_tokens == num_prompt + num_out
    assert out.id.startswith("cmpl-") and engine.submitted[0].request_id == out.id
    assert engine.submitted[0].prompt_token_ids == tokenizer.encode("Paris is")
    assert engine.aborted == []  # finished normally: nothing to abort


def test_completion_defaults_and_sampling_fields(serve: Serve) -> None:
    engine, server = serve()
    out = _client(server).completions.create(
        model="fake-model",
        prompt=[[5, 6, 7]],
        temperature=0,
        top_p=0.5,
        seed=3,
        extra_body={"top_k": -1, "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [9]},
    )
    sp = engine.submitted[0].sampling
    assert engine.submitted[0].prompt_token_ids == [5, 6, 7]
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (16, 0.0, 0.5, None, 3)
    assert (sp.ignore_eos, sp.min_tokens, sp.stop_token_ids) == (True, 2, frozenset({9}))
    assert out.choices[0].finish_reason == "stop"


def test_chat_with_openai_client(serve: Serve, tokenizer: Tokenizer) -> None:
    engine, server = serve(max_model_len=256)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]
    out = _client(server).chat.completions.create(
        model="fake-model", messages=messages, max_completion_tokens=4
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    ids = tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:4]
    assert out.choices[0].message.content == tokenizer.decode(ids)
    assert out.choices[0].finish_reason == "length"
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\n!"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(flat), add_special_tokens=False)
    assert engine.submitted[0].prompt_token_ids == prompt
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 4


def test_chat_default_max_tokens_is_rest_of_context(serve: Serve) -> None:
    engine, server = serve(max_model_len=64)
    _client(server).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Hi"}]
    )
    num_prompt = len(engine.submitted[0].prompt_token_ids)
    assert engine.submitted[0].sampling.max_tokens == 64 - num_prompt


def test_streaming_completion_with_usage(serve: Serve) -> None:
    engine, server = serve()
    stream = _client(server).completions.create(
        model="fake-model",
        prompt="Paris is",
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == OUTPUT_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(engine.output_ids)
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat_role_first_then_content(serve: Serve) -> None:
    _, server = serve()
    chunks = list(
        _client(server).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == OUTPUT_TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)  # include_usage not asked for


def test_sse_wire_format_and_request_id_header(serve: Serve) -> None:
    engine, server = serve()
    body = {"prompt": "Paris is", "max_tokens": 3, "stream": True}
    response = _post(server, "/v1/completions", body, headers={"X-Request-Id": "rid-42"})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = _sse(response)
    assert events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {"rid-42"}
    assert engine.submitted[0].request_id == "rid-42"
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["disagg"]["breakdown"] == {"queue_s": 0.001, "prefill_s": 0.002}


def test_stop_string_split_across_tokens_aborts_engine(serve: Serve, tokenizer: Tokenizer) -> None:
    text = "Tokyo 東京 is big; emoji 🙂 and 🚀 are fun."
    engine, server = serve(output_ids=tokenizer.encode(text, add_special_tokens=False))
    client = _client(server)
    out = client.completions.create(model="fake-model", prompt="x", max_tokens=100, stop=["京 is"])
    assert out.choices[0].text == "Tokyo 東"
    assert out.choices[0].finish_reason == "stop"
    assert engine.aborted == [out.id]  # the engine learned of the stop string from us
    assert out.usage.completion_tokens < len(engine.output_ids)
    stream = client.completions.create(
        model="fake-model", prompt="x", max_tokens=100, stop="🙂", stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "Tokyo 東京 is big; emoji "
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_until(lambda: chunks[-1].id in engine.aborted, "the finished stream is aborted")


def test_kv_transfer_params_round_trip(serve: Serve) -> None:
    returned = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "h"}
    engine, server = serve(kv_params_out=KVTransferParams.from_dict(returned))
    sent = {"do_remote_decode": True, "transfer_id": "t1"}
    body = {"prompt": "Paris", "max_tokens": 1, "kv_transfer_params": sent}
    assert _post(server, "/v1/completions", body).status_code == 403  # only the router's
    response = _post(server, "/v1/completions", body, signed=True)
    assert response.status_code == 200
    assert response.json()["kv_transfer_params"] == returned
    assert "breakdown" in response.json()["disagg"]
    params = engine.submitted[0].kv_transfer_params
    assert params is not None and params.do_remote_decode and params.transfer_id == "t1"
    events = _sse(_post(server, "/v1/completions", {**body, "stream": True}, signed=True))
    assert events[-2]["kv_transfer_params"] == returned


def test_error_finish_non_stream_and_stream(serve: Serve) -> None:
    engine, server = serve(error="kv transfer failed", error_after=3)
    response = _post(server, "/v1/completions", {"prompt": "Paris"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["message"], error["type"]) == ("kv transfer failed", "server_error")
    events = _sse(_post(server, "/v1/completions", {"prompt": "Paris", "stream": True}))
    assert events[0]["choices"][0]["text"]  # tokens before the failure were streamed
    assert events[-2]["error"]["message"] == "kv transfer failed"
    assert events[-1] == "[DONE]"
    assert engine.aborted == []  # the engine finished these itself


def test_error_before_first_chunk_is_plain_status(serve: Serve) -> None:
    _, server = serve(error="no route to prefill", error_after=1)
    response = _post(server, "/v1/completions", {"prompt": "Paris", "stream": True})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "no route to prefill"


@pytest.mark.parametrize(("refusal", "status"), [(ValueError, 400), (EngineOverloadedError, 503)])
def test_engine_refusal(serve: Serve, refusal: type[Exception], status: int) -> None:
    engine, server = serve(refuse=refusal)
    for stream in (False, True):
        response = _post(server, "/v1/completions", {"prompt": "Paris", "stream": stream})
        assert response.status_code == status
        assert "fake engine refuses" in response.json()["error"]["message"]
    assert engine.aborted == []  # a refused id may be another live request's


def test_unexpected_engine_failure_is_500_and_aborts(serve: Serve) -> None:
    engine, server = serve(crash_after=2)
    response = _post(server, "/v1/completions", {"prompt": "Paris"}, headers={"X-Request-Id": "a"})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    body = {"prompt": "Paris", "stream": True}
    events = _sse(_post(server, "/v1/completions", body, headers={"X-Request-Id": "b"}))
    assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    assert engine.aborted == ["a", "b"]


LONG = "Paris " * 300

BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    ("malformed json", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("not an object", "/v1/completions", [1, 2], 400, "invalid_json"),
    ("nan", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "invalid_json"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, None),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, None),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, None),
    ("several prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_parameter"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, None),
    ("empty ids", "/v1/completions", {"prompt": []}, 400, None),
    ("ids out of vocab", "/v1/completions", {"prompt": [1, 10**6]}, 400, None),
    ("negative id", "/v1/completions", {"prompt": [-1]}, 400, None),
    ("unknown model", "/v1/completions", {"prompt": "a", "model": "x"}, 404, "model_not_found"),
    ("too long", "/v1/completions", {"prompt": LONG}, 400, "context_length_exceeded"),
    ("max+prompt", "/v1/completions", {"prompt": "a", "max_tokens": 300}, 400, None),
    ("max_tokens 0", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, None),
    ("max_tokens str", "/v1/completions", {"prompt": "a", "max_tokens": "9"}, 400, None),
    ("temperature<0", "/v1/completions", {"prompt": "a", "temperature": -1}, 400, None),
    ("top_p 0", "/v1/completions", {"prompt": "a", "top_p": 0}, 400, None),
    ("top_p>1", "/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, None),
    ("n=2", "/v1/completions", {"prompt": "a", "n": 2}, 400, "unsupported_parameter"),
    ("best_of", "/v1/completions", {"prompt": "a", "best_of": 2}, 400, "unsupported_parameter"),
    ("logprobs 21", "/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "invalid_value"),
    ("echo", "/v1/completions", {"prompt": "a", "echo": True}, 400, "unsupported_parameter"),
    ("stop type", "/v1/completions", {"prompt": "a", "stop": [1]}, 400, None),
    ("min>max", "/v1/completions", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, None),
    ("kv unknown", "/v1/completions", {"prompt": "a", "kv_transfer_params": {"x": 1}}, 400, None),
    ("kv type", "/v1/completions", {"prompt": "a", "kv_transfer_params": [1]}, 400, None),
    ("stream_options", "/v1/completions", {"prompt": "a", "stream_options": {}}, 400, None),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, None),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400, None),
    (
        "image part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "unsupported_parameter",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        400,
        "invalid_value",
    ),
]


@pytest.mark.parametrize(("case", "path", "body", "status", "code"), BAD_REQUESTS)
def test_bad_input_is_openai_error(
    serve: Serve, case: str, path: str, body: Any, status: int, code: str | None
) -> None:
    engine, server = serve(max_model_len=256)
    response = _post(server, path, body)
    assert response.status_code == status, (case, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    assert engine.submitted == []
    ok = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200  # still serving


def test_openai_client_sees_typed_errors(serve: Serve) -> None:
    _, server = serve()
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="nope", prompt="a")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
        client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "a"}], n=3
        )


def test_unknown_route_and_method_use_error_shape(serve: Serve) -> None:
    _, server = serve()
    missing = requests.get(f"{server.url}/v2/nothing", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = requests.get(f"{server.url}/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def _open_stream(server: ServerThread, body: dict[str, Any]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: gone\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def test_client_disconnect_mid_stream_aborts(serve: Serve) -> None:
    engine, server = serve(output_ids=list(range(3, 200)), delay_s=0.02)
    sock = _open_stream(server, {"prompt": "a", "max_tokens": 150, "stream": True})
    received = b""
    while b"data: " not in received:  # bounded by the socket timeout
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")  # streaming has started
    sock.close()
    wait_until(lambda: engine.aborted == ["gone"], "the engine aborts the request")
    assert _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_client_disconnect_during_non_stream_aborts(serve: Serve) -> None:
    engine, server = serve(output_ids=list(range(3, 200)), delay_s=0.02)
    sock = _open_stream(server, {"prompt": "a", "max_tokens": 150})
    wait_until(lambda: len(engine.submitted) == 1, "the engine has the request")
    sock.close()
    wait_until(lambda: engine.aborted == ["gone"], "the engine aborts the request")


def test_abort_endpoint(serve: Serve) -> None:
    engine, server = serve()
    assert _post(server, "/v1/abort", {"request_id": "nobody"}).status_code == 401  # unsigned
    assert _post(server, "/v1/abort", {"request_id": "nobody"}, signed=True).status_code == 200
    assert engine.aborted == ["nobody"]
    assert _post(server, "/v1/abort", {"request_id": 3}, signed=True).status_code == 400


def test_abort_with_a_fence_says_whether_the_engine_held_the_request(serve: Serve) -> None:
    """`fence: true` is the router's question before it releases P's lease: "fenced" only
    when the engine never held the id (so it will refuse it from now on)."""
    engine, server = serve(output_ids=list(range(3, 200)), delay_s=0.02)
    sock = _open_stream(server, {"prompt": "a", "max_tokens": 150})
    wait_until(lambda: len(engine.submitted) == 1, "the engine has the request")
    held = _post(server, "/v1/abort", {"request_id": "gone", "fence": True}, signed=True)
    unknown = _post(server, "/v1/abort", {"request_id": "late", "fence": True}, signed=True)
    bad = _post(server, "/v1/abort", {"request_id": "x", "fence": "yes"}, signed=True)
    sock.close()
    assert (held.status_code, held.json()["fenced"]) == (200, False)
    assert (unknown.status_code, unknown.json()["fenced"]) == (200, True)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "fence"
    assert engine.aborted[0] == "gone" and engine.fenced == ["late"]


def test_instance_endpoints(serve: Serve) -> None:
    engine, server = serve()
    get = lambda path: requests.get(f"{server.url}{path}", timeout=10)  # noqa: E731
    assert get("/health").status_code == 200
    assert get("/load").json() == engine.load()
    assert get("/kv_info").json() == {"role": "both", "block_size": 16}
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    engine.healthy = False
    assert get("/health").status_code == 503


def test_metrics_parse(serve: Serve) -> None:
    engine, server = serve()
    _post(server, "/v1/completions", {"prompt": "Paris", "max_tokens": 3})
    _post(server, "/v1/completions", {"prompt": "Paris", "max_tokens": 50, "stop": "world"})
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("disagg_requests_total", (("finish_reason", "length"),))] == 1
    assert samples[("disagg_requests_total", (("finish_reason", "stop"),))] == 1
    assert samples[("disagg_generation_tokens_total", ())] >= 4
    assert samples[("disagg_ttft_seconds_count", ())] == 2
    assert samples[("disagg_ttft_stage_seconds_count", (("stage", "queue"),))] == 1
    assert samples[("disagg_kv_blocks_in_use", ())] == 10
    assert samples[("disagg_num_requests_running", ())] == 1
    assert samples[("disagg_num_requests_waiting", ())] == 2
