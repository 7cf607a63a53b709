"""The asyncio face of an engine: one loop thread steps the engine; the HTTP side talks to it
through a queue of typed commands (`_Add`, `_Abort`) and per-request asyncio queues (outputs).

Each submission runs under its own engine id (caller's id + `#n`): a reused caller's id never
reaches an old request's outputs. The loop thread never touches asyncio objects except through
`call_soon_threadsafe`; the asyncio side never touches the scheduler. Implements `EngineClient`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from disagg.config import EngineConfig
from disagg.engine.fences import Fences
from disagg.engine.native_thread import name_native_thread
from disagg.protocol import (
    KV_RELEASE_PATH,
    EngineOverloadedError,
    FinishReason,
    KVTransferParams,
    RequestFencedError,
    RequestIdInUseError,
    RequestOutput,
    SamplingParams,
)

__all__ = ["AsyncEngine"]

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # nothing to do: sleep until woken (new request) or this long
_KV_POLL_S = 0.0005  # only transfers in flight: poll them this often without spinning a core
_DEATH_EXIT_CODE = 70  # EX_SOFTWARE: the engine loop died; a supervisor should restart us
_DEATH_FLUSH_S = 0.5  # time for the failed requests' answers to leave before the exit


@dataclass(frozen=True, slots=True)
class _Add:
    """Submit a request under its engine id (stamped when the caller submitted it)."""

    engine_id: str
    prompt: list[int]
    sampling: SamplingParams
    params: KVTransferParams | None
    submitted_s: float


@dataclass(frozen=True, slots=True)
class _Abort:
    engine_id: str


_Command = _Add | _Abort


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        *,
        exit_on_death: bool = False,
        make_connector: Any = None,
    ):
        """exit_on_death: when the loop dies, fail every request and exit the process
        (a server's choice: a supervisor restarts it; an engine that cannot step must not
        live on as a zombie answering 503). make_connector: see Engine."""
        self.config = config
        self._make_connector = make_connector
        self.exit_on_death = exit_on_death
        self.exit_process = os._exit  # no cleanup: the loop is dead, peers' leases cover us
        self.model_dir, self.model_name = str(model_dir), config.model_name
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}  # engine id -> open stream
        self._open: dict[str, str] = {}  # caller's id -> engine id of its open stream
        # Caller's id -> engine id of its latest submission, while the engine may hold it (also
        # after its stream ended: a lease a peer may read). Asyncio side only.
        self._engine_ids: dict[str, str] = {}
        self._num_submitted = itertools.count(1)
        # Ids the router aborted before we took them: a late handler must not submit them.
        # Twice the lease: past one lease P's blocks are gone whatever we do (a load checks
        # its read deadline), the second covers a handler that was slow to start.
        self._fences = Fences(ttl_s=2 * config.kv_transfer.lease_s)
        self._held: set[str] = set()  # loop thread: engine ids added, not yet seen released
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping, self._dead = False, None  # _dead: why the loop died, once it has
        self._load: dict[str, int] = {}
        self.engine: Any = None  # disagg.engine.engine.Engine, built in start()
        self.dtype = config.dtype  # resolved ("auto" -> bfloat16 | float32 ...) in start()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from disagg.engine.engine import Engine  # torch is imported here, not at module load

        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(
            Engine,
            self.config,
            self.model_dir,
            wake=self._wakeup.set,
            make_connector=self._make_connector,
        )
        self.max_model_len = self.engine.max_model_len
        self.eos_token_ids = tuple(self.engine.spec.eos_token_ids)
        self.vocab_size = self.engine.spec.vocab_size
        self.dtype = self.engine.runner.dtype_name
        log.info("engine computes in %s (asked: %s)", self.dtype, self.config.dtype)
        self._load = self.engine.scheduler.load()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------------ EngineClient

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self._validate(request_id, prompt_token_ids, sampling, kv_transfer_params)
        engine_id = f"{request_id}#{next(self._num_submitted)}"
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[engine_id] = outputs
        self._open[request_id] = self._engine_ids[request_id] = engine_id
        # Stamped here, not when the loop thread drains the command after its current step.
        submitted_s = time.monotonic()
        self._send(_Add(engine_id, prompt_token_ids, sampling, kv_transfer_params, submitted_s))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.is_finished
                yield dataclasses.replace(output, request_id=request_id)
        finally:
            self._queues.pop(engine_id, None)
            del self._open[request_id]
            if not finished:
                self._send(_Abort(engine_id))  # the caller went away mid-request

    async def abort(self, request_id: str) -> None:
        """Abort the latest submission under the caller's id (an unknown id is a no-op)."""
        engine_id = self._open.get(request_id, self._engine_ids.get(request_id))
        if engine_id is not None:
            self._send(_Abort(engine_id))

    async def fence(self, request_id: str) -> bool:
        """Abort the id's submission if the engine may hold it (True); otherwise refuse any
        submission under it from now on (False: nothing here reads what it names). Runs on
        the event loop, as submission does, so no handler can slip in between."""
        if request_id in self._open or request_id in self._engine_ids:
            await self.abort(request_id)
            return True
        self._fences.add(request_id, time.monotonic())
        return False

    def load(self) -> dict[str, int]:
        return dict(self._load)

    def is_idle(self) -> bool:
        """No client stream open and nothing left in the engine (no request, no KV held for a
        peer): a draining instance may exit. Read from the event loop while the engine thread
        runs; a stale answer only delays the next check."""
        engine = self.engine
        return not self._queues and (engine is None or not engine.has_work)

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    def kv_events(self, epoch: str, seq: int) -> dict[str, Any]:
        """What the prefix cache gained and lost since (epoch, seq), or a snapshot of it
        (engine/kv_events.py); safe from the event loop while the engine thread runs."""
        events = self.engine.kv_events if self.engine is not None else None
        if events is None:
            return {"epoch": "", "seq": 0, "snapshot": []}  # no prefix cache: nothing to find
        # The block size keys the digests: a router hashing a prompt must use the same one.
        return {**events.since(epoch, seq), "block_size": self.config.cache.block_size}

    def kv_info(self) -> dict[str, Any]:
        connector = self.engine.kv_worker if self.engine is not None else None
        if connector is None:
            return {"role": "both", "model": self.model_name, "dtype": self.dtype}
        return {**connector.info(), "dtype": self.dtype}

    def set_address(self, host: str, port: int) -> None:
        """The HTTP address peers use for the KV side channel (known once the server listens)."""
        connector = self.engine.kv_worker if self.engine is not None else None
        if connector is not None:
            connector.set_address(host, port)

    def side_channel(self) -> dict[str, Any]:
        """The connector's KV side-channel handlers (path -> handler), for the server. A
        release may name the caller's id (the router's, when it never read our answer): it
        reaches the connector as the engine id."""
        connector = self.engine.kv_worker if self.engine is not None else None
        handlers = dict(connector.side_channel()) if connector is not None else {}
        if KV_RELEASE_PATH in handlers:
            handlers[KV_RELEASE_PATH] = self._resolving(handlers[KV_RELEASE_PATH])
        return handlers

    def _resolving(self, handler: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
        async def resolved(body: dict[str, Any]) -> Any:
            request_id = body.get("request_id")
            if isinstance(request_id, str):
                body = {**body, "request_id": self._engine_id_of(request_id)}
            return await handler(body)

        return resolved

    def _engine_id_of(self, request_id: str) -> str:
        """An engine id we handed out stays itself; a caller's id becomes its latest
        submission's engine id; anything else is passed on unchanged."""
        caller_id = request_id.rpartition("#")[0]
        if caller_id and self._engine_ids.get(caller_id) == request_id:
            return request_id
        return self._open.get(request_id, self._engine_ids.get(request_id, request_id))

    def _validate(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        params: KVTransferParams | None,
    ) -> None:
        if self._dead is not None:
            raise EngineOverloadedError(f"engine is dead: {self._dead}")
        if self._fences.holds(request_id, time.monotonic()):
            raise RequestFencedError(f"request {request_id!r} was aborted before it arrived")
        if request_id in self._open:
            raise RequestIdInUseError(
                f"request id {request_id!r} is in use by a request still running"
            )
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the context length {self.max_model_len}"
            )
        if params is not None:
            self._validate_kv_params(params, len(prompt))

    def _validate_kv_params(self, params: KVTransferParams, num_prompt_tokens: int) -> None:
        """A handoff this instance can serve, or ValueError: the wrong role's params would
        trip the scheduler's invariants, and a bad first token id would index past the
        vocabulary inside a model step."""
        role = self.config.kv_transfer.role
        if params.do_remote_prefill and role != "decode":
            raise ValueError(f"do_remote_prefill needs a decode instance; this one is {role}")
        if params.do_remote_decode and role != "prefill":
            raise ValueError(f"do_remote_decode needs a prefill instance; this one is {role}")
        first = params.first_token_id
        if first is not None and first >= self.vocab_size:
            raise ValueError(f"first_token_id must be in [0, {self.vocab_size}), got {first}")
        relayed = params.first_token_logprobs
        if relayed is not None and any(t >= self.vocab_size for t in relayed["top_ids"]):
            # The server detokenizes these ids: one past the vocabulary must not reach it.
            raise ValueError(f"first_token_logprobs.top_ids must be in [0, {self.vocab_size})")
        if params.num_prompt_tokens not in (None, num_prompt_tokens):
            raise ValueError(
                f"kv_transfer_params.num_prompt_tokens is {params.num_prompt_tokens}, "
                f"the prompt has {num_prompt_tokens} tokens"
            )

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        name_native_thread("engine-loop")  # its CPU time apart from the event loop's
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_work:
                    self._load = self.engine.scheduler.load()  # aborts free blocks while idle
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._load = self.engine.scheduler.load()
                self._forget_released()
                if outputs:
                    self._publish(outputs)
                elif not self.engine.scheduler.has_unfinished:
                    self._wait_for_kv()
        except Exception as exc:  # the loop must report its death, not vanish
            log.exception("engine loop died")
            self._dead = f"{type(exc).__name__}: {exc}"
            self._fail_all()
            if self.exit_on_death:
                self._exit_soon()

    def _exit_soon(self) -> None:
        assert self._loop is not None
        log.critical("exiting with code %d so that a supervisor restarts this instance",
                     _DEATH_EXIT_CODE)  # fmt: skip
        timer = threading.Timer(_DEATH_FLUSH_S, self.exit_process, (_DEATH_EXIT_CODE,))
        timer.daemon = True
        timer.start()

    def _wait_for_kv(self) -> None:
        """Only KV in flight: poll the loop's own transfers often; anything the connector's
        threads learn wakes us through report(), so otherwise sleep (deadlines checked at
        _IDLE_WAIT_S). Spinning empty steps here took a core from the prefill next door."""
        connector = self.engine.kv_worker
        polls = connector is not None and connector.needs_loop_poll()
        self._wakeup.wait(_KV_POLL_S if polls else _IDLE_WAIT_S)
        self._wakeup.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._add(command)
            else:
                self.engine.abort(command.engine_id)
        if outputs := self.engine.take_outputs():
            self._publish(outputs)  # an abort's final output: the stream ends now
        self._forget_released()

    def _forget_released(self) -> None:
        """Engine ids the engine no longer holds (no request, no blocks draining) stop being
        what a caller's id resolves to. Every request the scheduler holds came through _add,
        so while it holds as many as we added, none was released and there is nothing to scan."""
        scheduler = self.engine.scheduler
        if len(self._held) <= len(scheduler.requests):
            return
        gone = {
            e for e in self._held if e not in scheduler.requests and e not in scheduler.draining
        }
        if gone:
            self._held -= gone
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._forget, gone)

    def _forget(self, engine_ids: set[str]) -> None:
        for engine_id in engine_ids:
            caller_id = engine_id.rpartition("#")[0]
            if self._engine_ids.get(caller_id) == engine_id:  # not resubmitted since
                del self._engine_ids[caller_id]

    def _add(self, command: _Add) -> None:
        engine_id = command.engine_id
        self._held.add(engine_id)  # a refused one is forgotten at the next scan
        try:
            self.engine.add_request(
                engine_id, command.prompt, command.sampling, command.params,
                arrival_s=command.submitted_s,
            )  # fmt: skip
        except ValueError as exc:
            error = RequestOutput(engine_id, [], finish_reason=FinishReason.ERROR, error=str(exc))
            self._publish([error])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is not None:  # no listener: the caller already has its answer
                target.put_nowait(output)

    def _fail_all(self) -> None:
        assert self._loop is not None
        reason = f"engine loop died: {self._dead}"
        errors = [
            RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=reason)
            for rid in list(self._queues)
        ]
        self._loop.call_soon_threadsafe(self._dispatch, errors)
