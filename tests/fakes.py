"""Fakes and factories for pure-logic tests: a runner that returns fixed tokens, a connector
that finishes transfers after N polls, and small constructors with defaults."""

from __future__ import annotations

import itertools

from disagg.config import SchedulerConfig
from disagg.engine.block_pool import BlockPool
from disagg.engine.kv_connector import KVConnectorScheduler
from disagg.engine.outputs import KVConnectorOutput, KVFailure, RunnerOutput, SchedulerOutput
from disagg.engine.request import Request
from disagg.engine.scheduler import Scheduler
from disagg.protocol import KVTransferParams, RequestOutput, SamplingParams

_ids = itertools.count()


def make_request(
    num_tokens: int = 10,
    *,
    max_tokens: int = 4,
    prompt: list[int] | None = None,
    remote_decode: bool = False,
    remote_prefill: bool = False,
    first_token_id: int | None = None,
    request_id: str | None = None,
    **sampling: object,
) -> Request:
    params = None
    if remote_decode:
        params = KVTransferParams(do_remote_decode=True)
    elif remote_prefill:
        params = KVTransferParams(do_remote_prefill=True, first_token_id=first_token_id)
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=prompt if prompt is not None else [1 + i % 50 for i in range(num_tokens)],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),
        kv_transfer_params=params,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    connector: KVConnectorScheduler | None = None,
    eos_token_ids: tuple[int, ...] = (0,),
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
    return Scheduler(config, pool, block_size, eos_token_ids=eos_token_ids, connector=connector)


class FakeRunner:
    """Samples `token` (default 7) for every request that reaches the end of its sequence."""

    def __init__(self, token: int = 7) -> None:
        self.token = token

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(
            sampled_token_ids={s.request_id: self.token for s in sched.requests if s.do_sample}
        )


class FakeConnector(KVConnectorScheduler):
    """Both halves in one, for scheduler tests (run_step plays the engine's part).
    Remote prefill: every prompt token comes from remote; loads finish after `delay` polls.
    Remote decode: keeps blocks; sends finish after `delay` polls."""

    def __init__(self, delay: int = 1, fail: set[str] | None = None) -> None:
        super().__init__(block_size=4)
        self.delay = delay
        self.fail = fail or set()
        self.loading: dict[str, int] = {}
        self.sending: dict[str, int] = {}
        self.settling: dict[str, int] = {}  # aborted with a transfer in flight
        self.block_ids: dict[str, list[int]] = {}  # what each request's transfer touches
        self.new_loads: list[str] = []
        self.in_flight_on_abort = False
        self.aborted: list[str] = []

    def get_num_new_matched_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens if request.needs_remote_kv else 0

    def on_blocks_allocated(self, request: Request, block_ids: list[int], n: int) -> None:
        self.new_loads.append(request.request_id)
        self.block_ids[request.request_id] = list(block_ids)

    def build_meta(self) -> object:  # type: ignore[override]  # ids are enough here
        meta, self.new_loads = self.new_loads, []
        return meta

    def finished_params(self, request: Request, blocks: list[int], first: int) -> KVTransferParams:
        return KVTransferParams(do_remote_prefill=True, remote_block_ids=blocks)

    def request_finished(self, request: Request) -> tuple[bool, KVTransferParams | None]:
        if request.is_remote_decode and request.finish_status.name != "FINISHED_ABORTED":
            self.sending[request.request_id] = self.delay
            return True, self.finished_params(request, list(request.block_ids), 0)
        return False, None

    def request_aborted(self, request: Request) -> bool:
        self.aborted.append(request.request_id)
        self.loading.pop(request.request_id, None)
        self.sending.pop(request.request_id, None)
        if self.in_flight_on_abort:
            self.settling[request.request_id] = self.delay  # report it settled later
        return self.in_flight_on_abort

    def start_load(self, meta: object) -> None:
        for request_id in meta or []:
            self.loading[request_id] = self.delay

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for table, done in (
            (self.loading, out.finished_recving),
            (self.sending, out.finished_sending),
            (self.settling, out.settled),
        ):
            for request_id in list(table):
                table[request_id] -= 1
                if table[request_id] <= 0:
                    del table[request_id]
                    if request_id in self.fail:
                        out.failed[request_id] = KVFailure("injected failure")
                    else:
                        done.add(request_id)
        return out

    def has_pending(self) -> bool:
        return bool(self.loading or self.sending or self.settling)

    def blocks_in_use(self) -> set[int]:
        busy = [*self.loading, *self.settling]
        return {b for rid in busy for b in self.block_ids.get(rid, [])}


def run_step(
    sched: Scheduler, runner: FakeRunner, connector: FakeConnector | None = None, now: float = 0.0
):
    out = sched.schedule(now)
    runner_out = runner.execute(out)
    if connector is not None:
        connector.start_load(out.kv_meta)
        runner_out.kv = connector.get_finished()
    return out, sched.update(out, runner_out, now)


def drain(
    sched: Scheduler,
    runner: FakeRunner,
    connector: FakeConnector | None = None,
    max_steps: int = 200,
) -> list[RequestOutput]:
    """Step until nothing is unfinished or pending a transfer; every output on the way."""
    outputs = []
    for _ in range(max_steps):
        if not (sched.has_unfinished or sched.has_kv_pending):
            return outputs
        outputs.extend(run_step(sched, runner, connector)[1])
    raise AssertionError("scheduler did not drain")


def assert_no_leaks(sched: Scheduler) -> None:
    """No requests left, every block free, ref counts zero, books balanced."""
    assert not sched.requests, f"requests left: {list(sched.requests)}"
    assert not (sched.waiting or sched.running or sched.waiting_for_kv or sched.sending)
    assert not sched.draining
    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_blocks, (
        f"{pool.num_blocks - pool.num_free_blocks} blocks still in use"
    )
    pool.check_integrity()
