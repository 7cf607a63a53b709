"""Cluster signatures on plain values: what a call's MAC covers, answers bound to their call,
and the replay memory (each call accepted once, in bounded memory)."""

from __future__ import annotations

import dataclasses

import pytest

from disagg.security import auth

TOKEN = "unit-test-cluster-token-0123"
URL = "http://10.0.0.7:8100/kv/handshake"
BODY = b'{"engine_id": "decode-1"}'
NOW = 1_700_000_000.0


def _sign(request_id: str = "r-1") -> auth.Signature:
    return auth.sign(TOKEN, "POST", URL, BODY, request_id=request_id, now=NOW)


def _check(
    signature: auth.Signature,
    *,
    method: str = "POST",
    target: str = "/kv/handshake",
    body: bytes = BODY,
    request_id: str = "r-1",
    now: float = NOW,
) -> auth.Signature:
    """Check `signature` against a call as the verifier received it (defaults: as signed)."""
    header = signature.header
    return auth.check(TOKEN, header, method, target, body, request_id=request_id, now=now)


def test_a_signed_call_is_accepted_once() -> None:
    cache = auth.NonceCache()
    signature = _check(_sign())
    assert signature.authority == "10.0.0.7:8100"
    cache.admit(signature, NOW)
    with pytest.raises(auth.SignatureError, match="replayed"):
        cache.admit(_check(signature), NOW + 1)


def test_every_call_gets_its_own_nonce() -> None:
    first, second = _sign(), _sign()
    assert first.nonce != second.nonce and first.header != second.header
    cache = auth.NonceCache()
    cache.admit(first, NOW)
    cache.admit(second, NOW)  # the same call signed again is a new call
    assert len(cache) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("method", "PUT"),
        ("target", "/kv/register"),
        ("body", b'{"engine_id": "decode-2"}'),
        ("request_id", "r-2"),  # an altered X-Request-Id
        ("request_id", ""),  # or one dropped
    ],
)
def test_each_part_of_the_call_is_under_the_mac(field: str, value: object) -> None:
    with pytest.raises(auth.SignatureError, match="bad cluster signature"):
        _check(_sign(), **{field: value})


def test_the_destination_is_under_the_mac() -> None:
    """A relay cannot re-address a call: the `d=` it carries is signed."""
    signature = _sign()
    moved = dataclasses.replace(signature, authority="10.0.0.8:8100")
    with pytest.raises(auth.SignatureError, match="bad cluster signature"):
        auth.check(TOKEN, moved.header, "POST", "/kv/handshake", BODY, request_id="r-1", now=NOW)


def test_a_signature_outside_the_window_or_malformed_is_refused() -> None:
    with pytest.raises(auth.SignatureError, match="old"):
        _check(_sign(), now=NOW + auth.WINDOW_S + 1)
    with pytest.raises(auth.SignatureError, match="old"):
        _check(_sign(), now=NOW - auth.WINDOW_S - 1)  # from a clock far ahead of ours
    for header in ("", "t=1,s=00", "garbage", _sign().header.replace("n=", "x=")):
        with pytest.raises(auth.SignatureError):
            auth.check(TOKEN, header, "POST", "/kv/handshake", BODY, now=NOW)
    other = auth.sign("another-token-of-enough-length", "POST", URL, BODY, now=NOW)
    with pytest.raises(auth.SignatureError, match="bad"):
        auth.check(TOKEN, other.header, "POST", "/kv/handshake", BODY, now=NOW)


def test_an_answer_is_bound_to_its_call() -> None:
    """A recorded answer is no answer to any other call (nor with another status)."""
    call, other_call = _sign(), _sign()
    answer = auth.sign_answer(TOKEN, call.nonce, 200, b'{"metadata": "x"}')
    auth.check_answer(TOKEN, answer, call.nonce, 200, b'{"metadata": "x"}')
    with pytest.raises(auth.SignatureError, match="not for this call"):
        auth.check_answer(TOKEN, answer, other_call.nonce, 200, b'{"metadata": "x"}')
    with pytest.raises(auth.SignatureError, match="not for this call"):
        auth.check_answer(TOKEN, answer, call.nonce, 201, b'{"metadata": "x"}')
    with pytest.raises(auth.SignatureError, match="not for this call"):
        auth.check_answer(TOKEN, answer, call.nonce, 200, b'{"metadata": "y"}')
    with pytest.raises(auth.SignatureError, match="no cluster signature"):
        auth.check_answer(TOKEN, None, call.nonce, 200, b"{}")


def test_a_call_signature_is_never_an_answer_signature() -> None:
    call = _sign()
    as_answer = f"s={call.mac.hex()}"
    with pytest.raises(auth.SignatureError):
        auth.check_answer(TOKEN, as_answer, call.nonce, 200, BODY)


def test_nonces_are_forgotten_once_the_window_would_refuse_them() -> None:
    cache = auth.NonceCache(window_s=30.0)
    for i in range(100):
        cache.admit(dataclasses.replace(_sign(), stamp=int(NOW) + i % 3), NOW)
    assert len(cache) == 100
    cache.admit(_sign(), NOW + 33)  # every earlier stamp is now outside the window
    assert len(cache) == 1


def test_a_full_cache_shrinks_the_window_and_never_admits_a_replay() -> None:
    """At the bound the soonest-expiring nonce is forgotten, and every signature expiring as
    early is refused from then on: a replay of the forgotten one included."""
    cache = auth.NonceCache(window_s=30.0, max_num_nonces=3)
    signed = [dataclasses.replace(_sign(), stamp=int(NOW) + i) for i in range(4)]
    for signature in signed:
        cache.admit(signature, NOW + 3)
    assert len(cache) == 3
    with pytest.raises(auth.SignatureError, match="full"):
        cache.admit(signed[0], NOW + 3)  # forgotten, still refused
    for signature in signed[1:]:
        with pytest.raises(auth.SignatureError, match="replayed"):
            cache.admit(signature, NOW + 3)
    with pytest.raises(auth.SignatureError, match="full"):
        cache.admit(dataclasses.replace(_sign(), stamp=int(NOW)), NOW + 3)  # as old: refused
    cache.admit(dataclasses.replace(_sign(), stamp=int(NOW) + 3), NOW + 3)  # fresher: in
    assert len(cache) == 3


@pytest.mark.parametrize(
    ("url", "authority", "host"),
    [
        ("http://Router.Example:8000/internal/register", "router.example:8000", "router.example"),
        ("http://127.0.0.1/v1/abort", "127.0.0.1:80", "127.0.0.1"),
        ("https://10.1.2.3/kv/release", "10.1.2.3:443", "10.1.2.3"),
        ("http://[::1]:8100/kv/handshake", "[::1]:8100", "::1"),
    ],
)
def test_authority_of_writes_host_and_port_one_way(url: str, authority: str, host: str) -> None:
    assert auth.authority_of(url) == authority
    assert auth.split_authority(authority) == (host, int(authority.rsplit(":", 1)[1]))
