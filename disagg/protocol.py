"""Wire types shared by every part: sampling parameters, KV transfer parameters, engine outputs.

Pure Python, no torch: the router, the benchmark and the simulator import this module too.
Field names of `KVTransferParams` follow vLLM's so proxies and tools written for it carry over.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "DEREGISTER_PATH",
    "EngineOverloadedError",
    "FinishReason",
    "KVTransferParams",
    "KV_EVENTS_PATH",
    "KV_RELEASE_PATH",
    "REGISTER_PATH",
    "RequestFencedError",
    "RequestIdInUseError",
    "RequestOutput",
    "SamplingParams",
    "MAX_LOGPROBS",
    "TTFTBreakdown",
    "TokenLogprobs",
]


# The router's membership routes: an instance (disagg serve --router) posts its registration and
# heartbeats to the first, and leaves through the second (disagg.router.membership).
REGISTER_PATH = "/internal/register"
DEREGISTER_PATH = "/internal/deregister"
# A pull prefill instance's side-channel route that ends a lease nobody will read. Its body's
# request_id is the engine's id from `remote_request_id`, or the id the router sent the leg
# under (the instance resolves it): the router releases a lease whose answer it never read.
KV_RELEASE_PATH = "/kv/release"
# What an instance's prefix cache gained and lost (GET, signed: digests of cached prompts are
# not for clients), `?epoch=E&seq=N` the last answer seen (engine/kv_events.py).
KV_EVENTS_PATH = "/kv/events"


class EngineOverloadedError(RuntimeError):
    """The engine cannot take this request now (dead, or out of capacity): try again later.
    Raised by the engine side, answered 503 by the server."""


class RequestIdInUseError(ValueError):
    """A request under an id whose earlier request is still streaming: refused (the server
    answers 409), never attached to the earlier one's output."""


class RequestFencedError(ValueError):
    """A request under an id the router aborted before this instance took it (a fenced
    abort): refused (409), since the router may already have released the KV it names."""


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away or an operator aborted it
    ERROR = "error"  # the request failed (e.g. KV transfer failed under policy `fail`)


# Below this, logits / temperature overflows to inf for ordinary logits and the softmax turns
# to NaN; such a request asks for the argmax anyway (vLLM draws the same line).
GREEDY_BELOW_TEMPERATURE = 1e-5
# The most top alternatives a request may ask for per token (OpenAI's and vLLM's default cap):
# each costs a top-k over the vocabulary and bytes in every streamed chunk.
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16  # tokens to generate; >= 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int | None = None  # None = disabled
    seed: int | None = None  # per-request generator seed; None = engine's stream
    stop: tuple[str, ...] = ()  # stop strings (checked on detokenized text)
    # A set: the engine loop looks every sampled token up in it.
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS/stop ids are ignored before this many tokens
    # Top alternatives per sampled token, 0..MAX_LOGPROBS; None = compute no logprobs at all
    # (0 = only the sampled token's own logprob).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if not all(isinstance(s, str) for s in self.stop):
            raise TypeError("stop must be a string or a list of strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise TypeError("stop_token_ids must be a list of integers")
        if not isinstance(self.stop_token_ids, frozenset):  # a list or tuple from a caller
            object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def replace(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


@dataclass(slots=True, kw_only=True)
class KVTransferParams:
    """The `kv_transfer_params` object on a request or response (names as vLLM's).

    Request to P: `do_remote_decode=True` (keep the KV for a decode instance).
    Response from P (pull) / request to D: `do_remote_prefill=True` plus where the KV lives.
    Push: both legs carry the same fresh `transfer_id`; D's leg names P (`remote_*`).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None  # P's engine id (pull) / peer engine id (push)
    remote_host: str | None = None  # P's KV side-channel host
    remote_port: int | None = None  # P's KV side-channel port
    remote_block_ids: list[int] | None = None  # P's blocks holding the prompt KV (pull)
    remote_request_id: str | None = None  # the request id on P
    transfer_id: str | None = None  # push: one fresh id per dispatch, keys the two legs
    num_prompt_tokens: int | None = None  # tokens whose KV P computed
    first_token_id: int | None = None  # the token P sampled; D emits it as its first token
    # Pull: TokenLogprobs.to_dict() of first_token_id when the request asked for logprobs
    # (P computed them); None = unknown, and D answers null for that token's logprobs.
    first_token_logprobs: dict[str, Any] | None = None
    lease_s: float | None = None  # pull: P frees the blocks this long after answering
    connector: str | None = None  # "pull" | "push": both legs must agree

    @classmethod
    def from_dict(cls, raw: object) -> KVTransferParams:
        if not isinstance(raw, dict):
            raise TypeError("kv_transfer_params must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown kv_transfer_params fields: {unknown}")
        params = cls(**raw)
        params._validate()
        return params

    def _validate(self) -> None:
        """Types and ranges of every field: these values index block tables, name peers and
        time leases, so nothing unchecked may reach the engine."""
        for name in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"kv_transfer_params.{name} must be a boolean")
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill are exclusive")
        for name in _ID_FIELDS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= 256):
                raise TypeError(f"kv_transfer_params.{name} must be a string of 1-256 chars")
        ids = self.remote_block_ids
        if ids is not None and (
            not isinstance(ids, list) or not all(type(b) is int and b >= 0 for b in ids)
        ):
            raise TypeError("kv_transfer_params.remote_block_ids must be a list of block ids")
        if self.remote_port is not None and not (
            type(self.remote_port) is int and 0 < self.remote_port < 65536
        ):
            raise TypeError("kv_transfer_params.remote_port must be a port number")
        for name in ("num_prompt_tokens", "first_token_id"):
            value = getattr(self, name)
            if value is not None and not (type(value) is int and value >= 0):
                raise TypeError(f"kv_transfer_params.{name} must be an integer >= 0")
        if self.first_token_logprobs is not None:
            TokenLogprobs.from_dict(self.first_token_logprobs)  # raises on a malformed one
        if self.lease_s is not None:
            _check_number("kv_transfer_params.lease_s", self.lease_s)
            if self.lease_s <= 0:
                raise ValueError("kv_transfer_params.lease_s must be > 0")
        if self.connector not in (None, "pull", "push"):
            raise ValueError("kv_transfer_params.connector must be pull or push")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def to_sparse_dict(self) -> dict[str, Any]:
        """Only the fields set (None and False left out): the form the router's legs carry."""
        return {k: v for k, v in self.to_dict().items() if v is not False}


_ID_FIELDS = ("remote_engine_id", "remote_host", "remote_request_id", "transfer_id")


@dataclass(slots=True)
class TTFTBreakdown:
    """Critical-path timings of one request, in seconds (None = stage not on this path).

    Filled by each instance for its own stages; the router merges P's and D's.
    """

    queue_s: float | None = None  # arrival -> first scheduled (P, or aggregated)
    prefill_s: float | None = None  # first scheduled -> first token sampled
    handoff_setup_s: float | None = None  # allocation + descriptor prep + post (on the path)
    transfer_s: float | None = None  # post -> bytes landed
    decode_wait_s: float | None = None  # KV landed -> first decode step scheduled at D
    first_step_s: float | None = None  # first decode step at D
    # Not a TTFT stage: engine-loop time this instance spent on the request's KV handoff
    # (allocation bookkeeping, and with inline pull descriptor prep + post + polls). Every
    # running decode on the instance waited that long too.
    loop_blocked_s: float | None = None
    num_descriptors: int | None = None
    num_bytes: int | None = None  # KV bytes moved between instances for the request
    num_prefilled_tokens: int | None = None  # prompt tokens computed (where prefill ran)
    num_reused_tokens: int | None = None  # decode side: prompt tokens from its own cache

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def merge(self, other: TTFTBreakdown) -> TTFTBreakdown:
        mine, theirs = asdict(self), asdict(other)
        return TTFTBreakdown(**{k: mine[k] if mine[k] is not None else theirs[k] for k in mine})


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities around one sampled token, of the raw model distribution (log_softmax
    of the logits before temperature, top-k and top-p, as vLLM returns them by default)."""

    logprob: float  # natural log of the sampled token's probability; finite (clamped)
    top_ids: list[int]  # the most likely tokens, most likely first; len = SamplingParams.logprobs
    top_logprobs: list[float]  # their logprobs, same order and length as top_ids

    def to_dict(self) -> dict[str, Any]:
        return {"logprob": self.logprob, "top_ids": self.top_ids, "top_logprobs": self.top_logprobs}

    @classmethod
    def from_dict(cls, raw: object) -> TokenLogprobs:
        """The wire form (kv_transfer_params.first_token_logprobs), checked: TypeError if not
        {"logprob": number, "top_ids": [int >= 0], "top_logprobs": [number]} of equal lengths."""
        if not isinstance(raw, dict) or set(raw) != {"logprob", "top_ids", "top_logprobs"}:
            raise TypeError("first_token_logprobs must be {logprob, top_ids, top_logprobs}")
        ids, values = raw["top_ids"], raw["top_logprobs"]
        if not (
            _is_logprob(raw["logprob"])
            and isinstance(ids, list)
            and isinstance(values, list)
            and len(ids) == len(values) <= MAX_LOGPROBS
            and all(type(t) is int and t >= 0 for t in ids)
            and all(_is_logprob(v) for v in values)
        ):
            raise TypeError("first_token_logprobs has malformed values")
        return cls(float(raw["logprob"]), list(ids), [float(v) for v in values])


def _is_logprob(value: object) -> bool:
    # -inf is a real logprob (a token the model rules out) but not JSON: the sampler clamps it.
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request's output, produced by the engine loop for the server.

    `new_token_ids` holds only the tokens generated since the previous output of this request.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None  # None while still running
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including new_token_ids
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache or a remote prefill
    # Returned to the caller when finished (a prefill's answer: where its KV is, or which
    # transfer wrote it); JSON only at the HTTP edge (to_sparse_dict).
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None  # why, when finish_reason is ERROR
    breakdown: TTFTBreakdown = field(default_factory=TTFTBreakdown)
    # One entry per new_token_ids entry when the request asked for logprobs (an entry is None
    # where unknown: a first token relayed from a prefill instance that sent none); None when
    # it did not ask.
    new_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
