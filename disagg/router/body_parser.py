"""Parsing and checking a client's JSON body without stalling the router's event loop.

A small body is parsed where it arrives. A big one (up to the 16 MB body limit) goes to one
worker process: json.loads holds the GIL for the whole parse (~40 ms for 15 MB here), so a
worker thread would stall every stream the router relays meanwhile. The worker answers with
the parsed body, or with the refusal (status, message, param) for the caller to raise. Must
not send legs or know instances; call.py turns its answer into a Call.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

__all__ = ["INLINE_PARSE_BYTES", "BodyParser", "Refusal"]

log = logging.getLogger(__name__)

INLINE_PARSE_BYTES = 256 * 1024  # below this a parse takes < 1 ms: not worth a process hop

Refusal = tuple[int, str, str | None, str | None]  # (status, message, param, code) refused
ParseFn = Callable[[bytes, str, int | None], dict[str, Any]]


class BodyParser:
    """Runs `parse` (a module-level function, raising the caller's error type) inline for
    small bodies and in a worker process for big ones. `to_refusal` turns that error into a
    picklable Refusal in the worker; `from_refusal` raises it again here."""

    def __init__(
        self,
        parse: ParseFn,
        to_refusal: Callable[[Exception], Refusal | None],
        from_refusal: Callable[[Refusal], Exception],
    ) -> None:
        self._parse = parse
        self._to_refusal = to_refusal
        self._from_refusal = from_refusal
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker (spawned: forking a process with live threads is unsafe) and
        let it import the parser now, not on the first big request."""
        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=context)
        self._pool.submit(_warm_up)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def parse(self, raw: bytes, path: str, max_prompt_chars: int | None) -> dict[str, Any]:
        if len(raw) <= INLINE_PARSE_BYTES or self._pool is None:
            return self._parse(raw, path, max_prompt_chars)
        loop = asyncio.get_running_loop()
        job = (self._parse, self._to_refusal, raw, path, max_prompt_chars)
        try:
            ok, value = await loop.run_in_executor(self._pool, _parse_in_worker, *job)
        except BrokenProcessPool:
            # The worker died (killed, out of memory): start a new one and parse this body
            # here, slowly but correctly, rather than fail the request.
            log.warning("body parser process died; restarting it")
            self.close()
            self.start()
            return await asyncio.to_thread(self._parse, raw, path, max_prompt_chars)
        if not ok:
            raise self._from_refusal(value)
        return value


def _warm_up() -> None:
    return None


def _parse_in_worker(
    parse: ParseFn,
    to_refusal: Callable[[Exception], Refusal | None],
    raw: bytes,
    path: str,
    max_prompt_chars: int | None,
) -> tuple[bool, Any]:
    """(True, body) or (False, refusal): exceptions carrying aiohttp responses do not pickle."""
    try:
        return True, parse(raw, path, max_prompt_chars)
    except Exception as exc:
        refusal = to_refusal(exc)
        if refusal is None:
            raise
        return False, refusal
