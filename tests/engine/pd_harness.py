"""A prefill and a decode scheduler over symbolic KV, for the decode-side reuse tests.

Each block slot holds the (position, token) the runner computed there, so KV that a transfer or
a reuse put in the wrong place is read back as garbage: the sampled token is a function of the
whole context *as read from the blocks*, and an answer differs from the aggregated one as soon as
one slot is wrong. The real scheduler halves (`PullScheduler` / `PushScheduler`), the real
`Scheduler`, `KVCacheManager` and `BlockPool` run; only bytes and threads are played here, and
blocks are paired through the same `source_blocks` the connectors use.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from disagg.engine.kv_connector import KVConnectorMeta, KVReceive, KVSend, source_blocks
from disagg.engine.outputs import KVConnectorOutput, KVFailure, RunnerOutput, SchedulerOutput
from disagg.engine.request import Request
from disagg.engine.scheduler import Scheduler
from disagg.kv.common import KVIdentity
from disagg.kv.pull import PullScheduler
from disagg.kv.push import PushScheduler
from disagg.protocol import KVTransferParams, SamplingParams
from tests.fakes import make_scheduler

GARBAGE = -1  # what a slot reads as when it does not hold the token at that position
_ids = itertools.count()


class ContentRunner:
    """Writes (position, token) into the slots it computes; samples from what it reads."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.num_garbage_reads = 0

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        sampled = {}
        bs = self.block_size
        for s in sched.requests:
            context = [self._read(s.block_ids, pos) for pos in range(s.start_pos)]
            for offset, token in enumerate(s.token_ids):
                pos = s.start_pos + offset
                self.slots[(s.block_ids[pos // bs], pos % bs)] = (pos, token)
            if s.do_sample:
                sampled[s.request_id] = sample(context + list(s.token_ids))
        return RunnerOutput(sampled_token_ids=sampled)

    def copy_from(self, other: ContentRunner, src: list[int], dst: list[int]) -> None:
        """A transfer: every slot of each source block lands in its destination block."""
        for src_block, dst_block in zip(src, dst, strict=True):
            for offset in range(self.block_size):
                entry = other.slots.get((src_block, offset))
                if entry is None:
                    self.slots.pop((dst_block, offset), None)
                else:
                    self.slots[(dst_block, offset)] = entry

    def _read(self, block_ids: list[int], pos: int) -> int:
        entry = self.slots.get((block_ids[pos // self.block_size], pos % self.block_size))
        if entry is None or entry[0] != pos:
            self.num_garbage_reads += 1
            return GARBAGE
        return entry[1]


def sample(sequence: list[int]) -> int:
    """A deterministic 'model': depends on every token and its position; never 0 (EOS)."""
    return 1 + sum((i + 1) * t for i, t in enumerate(sequence)) % 97


def aggregated_answer(prompt: list[int], max_tokens: int, block_size: int = 4) -> list[int]:
    """The tokens one aggregated instance returns for the prompt."""
    sched = make_scheduler(num_blocks=256, block_size=block_size)
    runner = ContentRunner(block_size)
    sched.add_request(_request("agg", prompt, max_tokens, None))
    tokens: list[int] = []
    while sched.has_unfinished:
        out = sched.schedule(0.0)
        for output in sched.update(out, runner.execute(out), 0.0):
            tokens += output.new_token_ids
    return tokens


@dataclass
class _Handoff:
    d_id: str
    p_id: str
    receive: KVReceive | None = None
    send: KVSend | None = None


@dataclass
class Instance:
    sched: Scheduler
    runner: ContentRunner
    kv_out: KVConnectorOutput = field(default_factory=KVConnectorOutput)

    def step(self) -> tuple[KVConnectorMeta, list]:
        """One engine step: schedule, run, update; the KV work raised, merged."""
        out = self.sched.schedule(0.0)
        result = self.runner.execute(out)
        result.kv, self.kv_out = self.kv_out, KVConnectorOutput()
        outputs = self.sched.update(out, result, 0.0)
        metas = [m for m in (out.kv_meta, self.sched.take_kv_meta()) if m is not None]
        return _merge(metas), outputs


class PDPair:
    """One prefill and one decode instance of a mode ("pull" or "push"), with the transfers
    played by `step`. `fail` holds decode request ids whose transfer fails (by `recompute`)."""

    def __init__(
        self, mode: str, *, decode_blocks: int = 64, block_size: int = 4, recompute: bool = False
    ) -> None:
        self.mode, self.block_size, self.recompute = mode, block_size, recompute
        self.p = Instance(
            make_scheduler(256, block_size, connector=self._half("p")), ContentRunner(block_size)
        )
        self.d = Instance(
            make_scheduler(decode_blocks, block_size, connector=self._half("d")),
            ContentRunner(block_size),
        )
        self.handoffs: dict[str, _Handoff] = {}  # key: P's request id (pull), transfer id (push)
        self.fail: set[str] = set()
        self.hold: set[str] = set()  # decode request ids whose transfer waits (not yet landed)
        self.tokens: dict[str, list[int]] = {}
        self.errors: dict[str, str] = {}
        self.moved_blocks: dict[str, int] = {}  # decode request id -> blocks the transfer filled
        self.reused_blocks: dict[str, int] = {}
        self.prompts: dict[str, tuple[list[int], int]] = {}  # P's request id -> (prompt, max)

    def _half(self, name: str) -> PullScheduler | PushScheduler:
        identity = KVIdentity(name, "127.0.0.1", 1)
        if self.mode == "pull":
            return PullScheduler(self.block_size, identity, lease_s=60.0)
        return PushScheduler(self.block_size, identity)

    # ------------------------------------------------------------------ requests

    def submit(
        self, prompt: list[int], max_tokens: int, *, fail: bool = False, hold: bool = False
    ) -> str:
        """Send one request: push reserves on D first (early binding), pull prefills first and
        gives D the prefill's answer (late binding). `fail`: its transfer fails; `hold`: it
        does not land until `release`. Returns the decode request id."""
        n = next(_ids)
        p_id, d_id = f"p{n}", f"d{n}"
        if fail:
            self.fail.add(d_id)
        if hold:
            self.hold.add(d_id)
        key = p_id if self.mode == "pull" else f"t{n}"
        self.handoffs[key] = _Handoff(d_id, p_id)
        p_params = KVTransferParams(do_remote_decode=True, transfer_id=None)
        if self.mode == "push":
            p_params = dataclasses.replace(p_params, transfer_id=key, remote_engine_id="d")
            d_params = KVTransferParams(
                do_remote_prefill=True, transfer_id=key, remote_engine_id="p",
                remote_host="127.0.0.1", remote_port=1, connector="push",
            )  # fmt: skip
            self.d.sched.add_request(_request(d_id, prompt, max_tokens, d_params))
        self.p.sched.add_request(_request(p_id, prompt, 1, p_params))
        self.tokens[d_id] = []
        self.prompts[p_id] = (prompt, max_tokens)
        return d_id

    def release(self, d_id: str) -> None:
        self.hold.discard(d_id)

    def run(self, max_steps: int = 500) -> None:
        """Step both instances until nothing is left (held transfers excepted)."""
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("the pair did not drain")

    def step(self) -> bool:
        """One step of each instance, transfers played between. False when idle."""
        busy = self.p.sched.has_unfinished or self.p.sched.has_kv_pending
        busy = busy or self.d.sched.has_unfinished or self.d.sched.has_kv_pending
        p_meta, p_outputs = self.p.step()
        for output in p_outputs:
            if output.is_finished and self.mode == "pull" and output.kv_transfer_params:
                prompt, max_tokens = self.prompts[output.request_id]
                d_id = self.handoffs[output.request_id].d_id
                self.d.sched.add_request(
                    _request(d_id, prompt, max_tokens, output.kv_transfer_params)
                )
        for send in p_meta.sends:
            self.handoffs[self._key_of_send(send)].send = send
        for request_id in p_meta.aborts:
            self.p.kv_out.settled.add(request_id)
        d_meta, d_outputs = self.d.step()
        for output in d_outputs:
            self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.error:
                self.errors[output.request_id] = output.error
        for receive in d_meta.receives:
            self.handoffs[self._key_of_receive(receive)].receive = receive
        for request_id in d_meta.aborts:
            self.d.kv_out.settled.add(request_id)
        self._transfer()
        return busy

    def _transfer(self) -> None:
        for key, h in list(self.handoffs.items()):
            if h.receive is None or h.send is None or h.d_id in self.hold:
                continue
            del self.handoffs[key]
            self.p.kv_out.finished_sending.add(h.p_id)
            if h.d_id in self.fail:
                self.d.kv_out.failed[h.d_id] = KVFailure("injected", recompute=self.recompute)
                continue
            receive = h.receive
            prompt_blocks = (
                receive.params.remote_block_ids or [] if self.mode == "pull" else h.send.block_ids
            )
            src = source_blocks(prompt_blocks, receive.first_block, len(receive.block_ids))
            self.d.runner.copy_from(self.p.runner, src, list(receive.block_ids))
            self.moved_blocks[h.d_id] = len(receive.block_ids)
            self.reused_blocks[h.d_id] = receive.first_block
            self.d.kv_out.finished_recving.add(h.d_id)
            if h.send.first_token_id is not None:
                self.d.kv_out.first_token_ids[h.d_id] = h.send.first_token_id

    def _key_of_send(self, send: KVSend) -> str:
        return send.request_id if self.mode == "pull" else str(send.params.transfer_id)

    def _key_of_receive(self, receive: KVReceive) -> str:
        if self.mode == "pull":
            return str(receive.params.remote_request_id)
        return str(receive.params.transfer_id)

    def check(self) -> None:
        """Both pools balanced, no block a transfer may touch is free."""
        self.p.sched.check_integrity()
        self.d.sched.check_integrity()

    def assert_idle(self) -> None:
        """Nothing left on either side and every block back in its pool."""
        for inst in (self.p, self.d):
            sched = inst.sched
            assert not sched.requests, f"requests left: {list(sched.requests)}"
            pool = sched.block_pool
            assert pool.num_free_blocks == pool.num_blocks, "blocks still held"
            sched.check_integrity()


def _request(
    request_id: str, prompt: list[int], max_tokens: int, params: KVTransferParams | None
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        kv_transfer_params=params,
    )


def _merge(metas: list[KVConnectorMeta]) -> KVConnectorMeta:
    merged = KVConnectorMeta()
    for meta in metas:
        merged.receives += meta.receives
        merged.sends += meta.sends
        merged.aborts += meta.aborts
        merged.dropped += meta.dropped
    return merged
