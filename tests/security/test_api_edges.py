"""Bad input at the API edge: every refusal is a 4xx in the OpenAI error shape, never a 500.

Covers lone surrogate escapes (valid JSON, not encodable as UTF-8), nesting deep enough to blow
the parser's recursion (and anything past MAX_JSON_DEPTH), numbers that overflow to inf, and the
router's own 404/405/413 answers, first at `parse_json_body`, then through the instance app over
a fake engine, then through the router.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.config import RouterConfig
from disagg.router.app import make_app as make_router_app
from disagg.server.app import make_app as make_instance_app
from disagg.server.json_body import MAX_JSON_DEPTH, parse_json_body
from disagg.server.openai_api import APIError
from disagg.server.tokenizer import Tokenizer
from tests.router.fakes import FakeInstance, run_async, running
from tests.server.fakes import ScriptedEngine, make_tokenizer_dir

DEEP = 100_000  # far past the recursion limit of json.loads


def deep_list(levels: int) -> bytes:
    """An object whose "prompt" nests lists so the body has `levels` containers in all."""
    return b'{"prompt": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


def deep_dict(levels: int) -> bytes:
    """Objects nested `levels` deep: {"a": {"a": ... {}}}."""
    return b'{"a": ' * (levels - 1) + b"{}" + b"}" * (levels - 1)


SURROGATES = {
    "value": b'{"prompt": "\\ud800", "max_tokens": 2}',
    "low half": b'{"prompt": "ok \\udfff"}',
    "in a list": b'{"prompt": ["fine", "\\ud800"]}',
    "in a nested object": b'{"messages": [{"role": "user", "content": "\\udbff"}]}',
    "in a key": b'{"\\ud800": 1}',
    "in a nested key": b'{"logit_bias": {"\\ud800": 1}}',
    "reversed pair": b'{"prompt": "\\ude00\\ud83d"}',
}
TOO_DEEP = {
    "list 100k": deep_list(DEEP),
    "object 100k": deep_dict(DEEP),
    "list 65": deep_list(MAX_JSON_DEPTH + 1),
    "object 65": deep_dict(MAX_JSON_DEPTH + 1),
}
OVERFLOWS = {
    "temperature 1e309": b'{"prompt": "x", "temperature": 1e309}',
    "top_p -1e309": b'{"prompt": "x", "top_p": -1e309}',
    "in a list": b'{"prompt": [1, 2, 1E+400]}',
    "in a nested object": b'{"logit_bias": {"5": -1e309}}',
    "deep in lists": b'{"stop": [[["a", 1e999]]]}',
}
BAD_BODIES = {
    **{f"surrogate {k}": v for k, v in SURROGATES.items()},
    **{f"deep {k}": v for k, v in TOO_DEEP.items()},
    **{f"overflow {k}": v for k, v in OVERFLOWS.items()},
}


# ---- parse_json_body --------------------------------------------------------------------------


def _refusal(raw: bytes) -> APIError:
    """The APIError parse_json_body raises for `raw` (it must raise one)."""
    with pytest.raises(APIError) as info:
        parse_json_body(raw)
    return info.value


@pytest.mark.parametrize("raw", SURROGATES.values(), ids=SURROGATES.keys())
def test_parse_refuses_lone_surrogates(raw: bytes) -> None:
    """A lone surrogate escape (valid JSON, not encodable as UTF-8) anywhere, keys included."""
    error = _refusal(raw)
    assert (error.status, error.code) == (400, "invalid_value")
    assert "surrogate" in error.message


def test_parse_refuses_raw_surrogate_bytes() -> None:
    """A surrogate encoded straight into the bytes: json.loads decodes bytes with
    "surrogatepass", so it parses to a lone surrogate like the escape does."""
    error = _refusal(b'{"prompt": "\xed\xa0\x80"}')
    assert (error.status, error.code) == (400, "invalid_value")


@pytest.mark.parametrize("raw", TOO_DEEP.values(), ids=TOO_DEEP.keys())
def test_parse_refuses_deep_nesting(raw: bytes) -> None:
    """100k-deep nesting (RecursionError inside json.loads) and one level past MAX_JSON_DEPTH."""
    error = _refusal(raw)
    assert (error.status, error.code) == (400, "invalid_json")
    assert str(MAX_JSON_DEPTH) in error.message


@pytest.mark.parametrize("raw", OVERFLOWS.values(), ids=OVERFLOWS.keys())
def test_parse_refuses_numbers_that_overflow_to_inf(raw: bytes) -> None:
    """1e309 / -1e309 (json.loads makes them +-inf) at the top level and nested."""
    error = _refusal(raw)
    assert (error.status, error.code) == (400, "invalid_value")
    assert "finite" in error.message


@pytest.mark.parametrize("raw", [b'{"t": NaN}', b'{"t": [Infinity]}', b'{"t": -Infinity}'])
def test_parse_still_refuses_nan_and_infinity_constants(raw: bytes) -> None:
    """The NaN/Infinity literals json.loads accepts by default."""
    error = _refusal(raw)
    assert error.status == 400


def test_parse_accepts_normal_bodies() -> None:
    """Good input still parses: unicode (raw and as an escaped surrogate pair), depth 5, the
    deepest allowed body, large finite numbers and a long token-id prompt."""
    text = "héllo 日本 😀"
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode()) == body
    assert parse_json_body(json.dumps(body).encode()) == body  # 😀 as \ud83d\ude00
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "😀"}
    assert parse_json_body(b'{"t": 1e308, "s": -1.5e-320, "n": 123456789012345678901234}')
    assert parse_json_body(deep_list(MAX_JSON_DEPTH))
    assert parse_json_body(deep_dict(MAX_JSON_DEPTH))
    assert parse_json_body(json.dumps({"prompt": list(range(100_000))}).encode())


# ---- the instance app over a fake engine -------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(Path(tmp_path_factory.mktemp("tok"))))


def with_client(app: Callable[[], Any], test: Callable[[TestClient], Awaitable[None]]) -> None:
    """Run `test` against the app served in-process by aiohttp's test server."""

    async def main() -> None:
        async with TestClient(TestServer(app())) as client:
            await test(client)

    run_async(main(), timeout_s=60)


async def error_of(resp: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    """The `error` object of a JSON error answer with this status."""
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    return body["error"]


def test_instance_answers_every_bad_body_with_400_then_serves(tokenizer: Tokenizer) -> None:
    """Lone surrogates, 100k/65-deep nesting and 1e309 on both endpoints: 400, OpenAI error
    shape with its four fields; the engine never sees them and a normal request then succeeds."""
    engine = ScriptedEngine(output_ids=tokenizer.encode("Hello world", add_special_tokens=False))

    async def test(client: TestClient) -> None:
        for name, raw in BAD_BODIES.items():
            for path in ("/v1/completions", "/v1/chat/completions"):
                async with client.post(path, data=raw) as resp:
                    error = await error_of(resp, 400)
                assert set(error) == {"message", "type", "param", "code"}, name
                assert error["type"] == "invalid_request_error", name
                assert error["code"] in ("invalid_json", "invalid_value"), name
        body = {"prompt": "héllo 日本", "max_tokens": 2}
        async with client.post("/v1/completions", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["choices"][0]["text"]

    with_client(lambda: make_instance_app(engine, tokenizer), test)
    assert len(engine.submitted) == 1


# ---- the router ---------------------------------------------------------------------------------


def router_app(decode_url: str = "http://127.0.0.1:9", **kwargs: Any) -> Callable[[], Any]:
    cfg = RouterConfig(host="127.0.0.1", port=0, decode_urls=(decode_url,))
    return lambda: make_router_app(cfg, **kwargs)


def assert_router_error(error: dict[str, Any], status: int) -> None:
    assert {"message", "type", "code"} <= set(error)
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_router_unknown_path_is_404_json() -> None:
    """An unknown path: aiohttp's plain-text 404 becomes an OpenAI-shaped JSON error."""

    async def test(client: TestClient) -> None:
        for method, path in (("GET", "/nope"), ("POST", "/v1/embeddings"), ("GET", "/v1")):
            async with client.request(method, path) as resp:
                assert_router_error(await error_of(resp, 404), 404)

    with_client(router_app(), test)


def test_router_wrong_method_is_405_json() -> None:
    """GET on a POST-only endpoint: 405 as JSON, keeping the Allow header."""

    async def test(client: TestClient) -> None:
        for path in ("/v1/completions", "/v1/chat/completions"):
            async with client.get(path) as resp:
                assert_router_error(await error_of(resp, 405), 405)
                assert "POST" in resp.headers["Allow"]

    with_client(router_app(), test)


def test_router_body_over_the_limit_is_413_json() -> None:
    """A body over client_max_size (set small here; the default is cfg.max_request_bytes)."""

    async def test(client: TestClient) -> None:
        raw = json.dumps({"prompt": list(range(2000))}).encode()
        async with client.post("/v1/completions", data=raw) as resp:
            error = await error_of(resp, 413)
        assert_router_error(error, 413)
        assert "1024" in error["message"]

    with_client(router_app(client_max_size=1024), test)


def test_router_default_limit_takes_a_body_over_aiohttps_1mib() -> None:
    """A 2 MiB token-id prompt is read and parsed, not refused as too large: with no instance
    up the router gets as far as routing it (502/503), where aiohttp's default would say 413."""

    async def test(client: TestClient) -> None:
        raw = json.dumps({"prompt": [7] * (1024 * 1024), "max_tokens": 1}).encode()
        assert len(raw) > 2 * 1024 * 1024
        async with client.post("/v1/completions", data=raw) as resp:
            assert resp.status in (502, 503), await resp.text()

    with_client(router_app(), test)


def test_router_bad_json_is_400_json_then_serves() -> None:
    """Malformed JSON, raw surrogate bytes, lone surrogate escapes, 100k/65-deep nesting and
    1e309: 400 in the router's OpenAI error shape, nothing forwarded; then a normal request
    goes through."""
    fake = FakeInstance("both")
    bodies = {"malformed": b'{"prompt": ', "raw surrogate": b'{"prompt": "\xed\xa0\x80"}'}

    async def main() -> None:
        async with running(fake) as (url,):
            async with TestClient(TestServer(router_app(url)())) as client:
                for name, raw in {**bodies, **BAD_BODIES}.items():
                    async with client.post("/v1/chat/completions", data=raw) as resp:
                        error = await error_of(resp, 400)
                    assert_router_error(error, 400)
                    assert error["code"] in ("invalid_json", "invalid_value"), name
                body = {"prompt": "héllo 日本", "max_tokens": 2}
                async with client.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200

    run_async(main(), timeout_s=60)
    assert [r.body["prompt"] for r in fake.received] == ["héllo 日本"]


def test_router_unexpected_exception_is_500_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside a handler: logged, answered 500 as JSON rather than aiohttp's text page."""

    async def boom(*_args: Any) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr("disagg.router.app.parse_call", boom)

    async def test(client: TestClient) -> None:
        async with client.post("/v1/completions", json={"prompt": "x"}) as resp:
            error = await error_of(resp, 500)
        assert_router_error(error, 500)
        assert "bug" not in error["message"]

    with_client(router_app(), test)


# ---- an Authorization header that is not ASCII --------------------------------------------------

ODD_AUTHORIZATIONS = {
    "utf-8 key": "Bearer ключ".encode(),
    "latin-1 key": "Bearer clé".encode("latin-1"),
    "invalid utf-8": b"Bearer \xff\xfe",
    "utf-8 scheme": "Бearer sk-edge".encode(),
}
API_KEY = "sk-edge"


async def post_with_authorization(client: TestClient, authorization: bytes) -> tuple[int, Any]:
    """POST /v1/completions with this Authorization header written as raw bytes (HTTP clients
    will not encode such a value); (status, JSON body)."""
    server = client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    body = b'{"prompt": "hi", "max_tokens": 2}'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nAuthorization: %s\r\n\r\n"
    ) % (len(body), authorization)
    writer.write(head + body)
    raw = await reader.read()
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize("authorization", ODD_AUTHORIZATIONS.values(), ids=list(ODD_AUTHORIZATIONS))
def test_non_ascii_authorization_is_401_not_500(tokenizer: Tokenizer, authorization: bytes) -> None:
    """Regression: hmac.compare_digest raised TypeError on a non-ASCII key (HTTP 500 with a
    traceback) on the instance and on the router. Now a wrong key like any other: 401."""
    engine = ScriptedEngine(output_ids=tokenizer.encode("Hello", add_special_tokens=False))
    apps = {
        "instance": lambda: make_instance_app(engine, tokenizer, api_key=API_KEY),
        "router": lambda: make_router_app(
            RouterConfig(
                host="127.0.0.1", port=0, decode_urls=("http://127.0.0.1:9",), api_key=API_KEY
            )
        ),
    }

    async def test(client: TestClient) -> None:
        status, body = await post_with_authorization(client, authorization)
        assert status == 401, body
        assert body["error"]["type"] == "invalid_request_error"

    for app in apps.values():
        with_client(app, test)
    assert engine.submitted == []


def test_non_ascii_authorization_through_an_open_router_is_not_500() -> None:
    """A router without a key of its own forwards the header to the instance: it arrives there
    unchanged (the instance decides), or the router refuses it; never a 500."""
    fake = FakeInstance("both")

    async def main() -> None:
        async with running(fake) as (url,):
            async with TestClient(TestServer(router_app(url)())) as client:
                for authorization in ODD_AUTHORIZATIONS.values():
                    status, body = await post_with_authorization(client, authorization)
                    assert status == 200 or 400 <= status < 500, body

    run_async(main(), timeout_s=60)


# ---- the error code: a string (or null), as OpenAI's is ----------------------------------------


def assert_code_is_text(error: dict[str, Any], name: str) -> None:
    assert error["code"] is None or isinstance(error["code"], str), (name, error)


def test_error_code_is_a_string_on_the_instance_and_through_the_router(
    tokenizer: Tokenizer,
) -> None:
    """Regression: through the router an unknown model said `"code": "model_not_found"` (the
    instance's answer, relayed) but a malformed body `"code": 400` (the router's own)."""
    engine = ScriptedEngine(output_ids=tokenizer.encode("Hello", add_special_tokens=False))
    calls = {  # name -> (method, path, body, status)
        "unknown model": ("POST", "/v1/completions", b'{"model": "nope", "prompt": "x"}', 404),
        "malformed": ("POST", "/v1/chat/completions", b'{"prompt": ', 400),
        "too deep": ("POST", "/v1/completions", deep_list(DEEP), 400),
        "unknown path": ("GET", "/nope", None, 404),
        "wrong method": ("GET", "/v1/completions", None, 405),
    }

    async def check(client: TestClient) -> dict[str, Any]:
        codes = {}
        for name, (method, path, raw, status) in calls.items():
            async with client.request(method, path, data=raw) as resp:
                error = await error_of(resp, status)
            assert_code_is_text(error, name)
            codes[name] = error["code"]
        return codes

    async def main() -> None:
        instance = TestServer(make_instance_app(engine, tokenizer))
        async with TestClient(instance) as direct:
            on_instance = await check(direct)
            url = str(direct.make_url("")).rstrip("/")
            async with TestClient(TestServer(router_app(url)())) as routed:
                through_router = await check(routed)
        assert on_instance["unknown model"] == through_router["unknown model"] == "model_not_found"
        assert on_instance["malformed"] == through_router["malformed"] == "invalid_json"
        assert through_router["unknown path"] == "not_found"
        assert through_router["wrong method"] == "method_not_allowed"

    run_async(main(), timeout_s=60)


def test_router_refusals_of_its_own_carry_string_codes() -> None:
    """The router's 401 (API key), 413 (body size) and 502/503 (no instance up) too."""

    async def test(client: TestClient) -> None:
        async with client.post("/v1/completions", json={"prompt": "x"}) as resp:
            error = await error_of(resp, 401)
        assert error["code"] == "invalid_api_key"  # as the instance says it
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with client.post("/v1/completions", data=b"x" * 2048, headers=headers) as resp:
            assert_code_is_text(await error_of(resp, 413), "413")
        async with client.post("/v1/completions", json={"prompt": "x"}, headers=headers) as resp:
            assert resp.status in (502, 503), await resp.text()
            assert_code_is_text((await resp.json())["error"], "no instance")

    cfg = RouterConfig(
        host="127.0.0.1", port=0, decode_urls=("http://127.0.0.1:9",), api_key=API_KEY
    )
    with_client(lambda: make_router_app(cfg, client_max_size=1024), test)
