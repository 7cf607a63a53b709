"""One generation request in flight at the HTTP layer: what it has sent, and its engine calls.

`Generation` keeps a request's response state (chunks and logprobs sent, the latest engine
delta) and turns engine refusals and failures into the `APIError` the client gets. It builds
bodies through openai_responses.py; it must not write to the connection or abort the engine
(the app does both).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.protocol import RequestOutput
from disagg.server.engine_client import (
    EngineOverloadedError,
    RequestFencedError,
    RequestIdInUseError,
)
from disagg.server.openai_api import APIError, GenerateRequest
from disagg.server.openai_responses import (
    LogprobEntry,
    ResponseMeta,
    chat_logprobs,
    completion_logprobs,
    response_body,
    response_chunk,
    usage_dict,
)
from disagg.server.output_processor import OutputProcessor, TextDelta

__all__ = ["Generation", "Submit"]

logger = logging.getLogger(__name__)

Submit = Callable[[], AsyncIterator[RequestOutput]]


@dataclass(slots=True, kw_only=True)
class Generation:
    """One generation request in flight at the HTTP layer."""

    meta: ResponseMeta
    request: GenerateRequest
    num_prompt_tokens: int
    processor: OutputProcessor
    arrival_s: float  # time.monotonic() at arrival
    first_token_s: float | None = None  # first output token seen (monotonic)
    last_output: RequestOutput | None = None  # latest engine delta (breakdown, kv params)
    num_chunks_sent: int = 0
    is_refused: bool = False  # the engine refused it: never accepted, so nothing to abort
    # Every token's logprobs so far (empty unless the request asked); a chunk carries those
    # from num_logprobs_sent on, so a token whose text is held back rides the next chunk.
    logprob_entries: list[LogprobEntry] = field(default_factory=list)
    num_logprobs_sent: int = 0

    def process(self, output: RequestOutput) -> TextDelta:
        if self.first_token_s is None and output.new_token_ids:
            self.first_token_s = time.monotonic()
        self.last_output = output
        step = self.processor.process(output)
        self.logprob_entries.extend(step.logprobs or ())
        return step

    def logprobs(self, start: int = 0) -> dict[str, Any] | None:
        """The choice's `logprobs` over entries from `start`; None when it did not ask."""
        if self.request.sampling.logprobs is None:
            return None
        entries = self.logprob_entries[start:]
        return chat_logprobs(entries) if self.request.is_chat else completion_logprobs(entries)

    @property
    def is_engine_finished(self) -> bool:
        return self.last_output is not None and self.last_output.is_finished

    def usage(self) -> dict[str, int]:
        return usage_dict(self.num_prompt_tokens, self.processor.num_output_tokens)

    def final_extra(self) -> dict[str, Any]:
        """Our additions to the body / final chunk: returned kv params and the TTFT breakdown."""
        last = self.last_output
        extra: dict[str, Any] = {"disagg": {"breakdown": last.breakdown.to_dict() if last else {}}}
        if last is not None and last.is_finished and last.kv_transfer_params is not None:
            extra["kv_transfer_params"] = last.kv_transfer_params.to_sparse_dict()
        return extra

    def body(self) -> dict[str, Any]:
        """The whole answer, once the request has finished."""
        finish_reason = self.processor.finish_reason
        assert finish_reason is not None, f"{self.meta.request_id}: drive returned unfinished"
        text, is_chat = self.processor.text, self.request.is_chat
        extra, logprobs = self.final_extra(), self.logprobs()
        return response_body(self.meta, is_chat, text, finish_reason, self.usage(), extra, logprobs)

    def chunk(self, step: TextDelta) -> dict[str, Any] | None:
        """The SSE chunk for one step, or None when it carries nothing."""
        if not step.text and step.finish_reason is None:
            return None
        extra = self.final_extra() if step.finish_reason is not None else {}
        self.num_chunks_sent += 1
        logprobs = self.logprobs(self.num_logprobs_sent)
        self.num_logprobs_sent = len(self.logprob_entries)
        content: dict[str, Any] = {"text": step.text}
        if self.request.is_chat:
            delta = {"content": step.text} if step.text else {}
            if self.num_chunks_sent == 1:
                delta = {"role": "assistant", "content": step.text}
            content = {"delta": delta}
        is_chat, reason = self.request.is_chat, step.finish_reason
        return response_chunk(self.meta, is_chat, content, reason, extra, logprobs)

    def submit(self, submit: Submit) -> AsyncIterator[RequestOutput]:
        try:
            return submit()
        except Exception as exc:
            raise self.engine_error(exc) from exc

    async def next_output(self, outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        """The next engine delta, None when the iterator ends; engine exceptions become
        APIError."""
        try:
            return await anext(outputs)
        except StopAsyncIteration:
            return None
        except Exception as exc:
            raise self.engine_error(exc) from exc

    def engine_error(self, exc: Exception) -> APIError:
        # Per EngineClient: ValueError = the engine refused this request; overload = try later.
        # A refused id may belong to another live request (duplicate id): it must not be aborted.
        if isinstance(exc, EngineOverloadedError):
            self.is_refused = True
            return APIError(503, str(exc) or "engine overloaded", code="engine_overloaded")
        if isinstance(exc, RequestFencedError):
            self.is_refused = True
            return APIError(409, str(exc), code="request_aborted", param="X-Request-Id")
        if isinstance(exc, RequestIdInUseError):
            self.is_refused = True
            return APIError(409, str(exc), code="request_id_in_use", param="X-Request-Id")
        if isinstance(exc, ValueError):
            self.is_refused = True
            return APIError(400, str(exc), code="request_refused")
        logger.error("%s: engine failed", self.meta.request_id, exc_info=exc)
        return APIError(500, f"engine error: {type(exc).__name__}", code="internal_error")
