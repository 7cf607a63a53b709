"""The simulated router: the three flows of `router/flows.py` on the virtual clock, choosing
instances with the real `router/policy.py` from the instances' live `load()`.

- aggregated: one leg to a `both` instance.
- pull: P leg (max_tokens=1, do_remote_decode); D is chosen when P's answer reaches the router
  (late binding) and gets P's kv_transfer_params.
- push: P and D chosen together with a fresh transfer id, both legs sent at once.
Under kv_aware the router's own index (router/kv_index.py) follows each instance's cache
events (engine/kv_events.py) before every choice, as the real router does every poll, and
`local_prefill_tokens` sends a request whose uncached part is short to D whole (flows.py).
Every hop (router -> instance, instance -> router -> client) costs one `http_hop_s`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from disagg.bench.metrics import RequestResult
from disagg.engine.block_pool import hash_blocks
from disagg.engine.request import Request
from disagg.protocol import FinishReason, KVTransferParams, RequestOutput, SamplingParams
from disagg.router.kv_index import KV_AWARE_INDEX_BLOCKS, KVIndex, with_cached_tokens
from disagg.router.policy import InstanceView, Load, Policy, make_policy, uncached_at_pick
from disagg.sim.events import EventLoop
from disagg.sim.host_cpu import CpuShare
from disagg.sim.instance import SimInstance

__all__ = ["ClientRequest", "SimRouter"]


@dataclass(slots=True)
class ClientRequest:
    """One request as the client sees it, plus the legs' breakdowns."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    result: RequestResult
    prefill_breakdown: dict[str, float] = field(default_factory=dict)
    is_done: bool = False
    # (block size, the prompt's chain digests): both legs hash the same prompt, and the digests
    # are a pure function of the tokens, so they are computed once and each leg gets a copy.
    # (Real instances each hash; no simulated time is charged for it either way. At 16k-token
    # prompts this was a tenth of the simulator's wall time.)
    prompt_hashes: tuple[int, list[bytes]] | None = None
    output_ids: list[int] | None = None  # the answer's token ids, kept when not None
    on_done: Callable[[ClientRequest], None] | None = None  # a conversation's next turn


def _prompt_hashes(request: ClientRequest, block_size: int) -> list[bytes]:
    if request.prompt_hashes is None or request.prompt_hashes[0] != block_size:
        hashes = hash_blocks(None, request.prompt_token_ids, block_size)
        request.prompt_hashes = (block_size, hashes)
    return request.prompt_hashes[1]


class SimRouter:
    def __init__(
        self,
        mode: str,
        instances: Sequence[SimInstance],
        loop: EventLoop,
        http_hop_s: float,
        *,
        policy: str = "least_loaded",
        max_concurrency: int | None = None,
        request_tokens: int = 16,
        local_prefill_tokens: int = 0,
        cpu: CpuShare | None = None,
    ) -> None:
        self.mode = mode
        self.cpu = cpu or CpuShare(loop, None)  # legs and streamed tokens cost the host CPU
        self.prefill = [i for i in instances if i.role in ("prefill", "both")]
        self.decode = [i for i in instances if i.role == "decode"]
        self.loop = loop
        self.hop_s = http_hop_s
        self.max_concurrency = max_concurrency
        self.requests: dict[str, ClientRequest] = {}
        self._policies: dict[str, Policy] = {
            role: make_policy(policy, request_tokens=request_tokens)
            for role in ("prefill", "decode")
        }
        self.kv_index = KVIndex(KV_AWARE_INDEX_BLOCKS) if policy == "kv_aware" else None
        self.local_prefill_tokens = local_prefill_tokens
        self.num_local_prefills = 0  # requests prefilled on D (conditional disaggregation)
        self._num_pending: dict[str, int] = {i.engine_id: 0 for i in instances}
        self._transfer_ids = itertools.count()
        self._queued: deque[ClientRequest] = deque()  # over max_concurrency
        self._num_in_flight = 0
        for instance in instances:
            instance.on_outputs = self._on_outputs

    # ------------------------------------------------------------------ intake

    def submit(self, request: ClientRequest) -> None:
        """The client has `request` to send now (it waits for a slot under max_concurrency)."""
        self.requests[request.request_id] = request
        if self.max_concurrency is not None and self._num_in_flight >= self.max_concurrency:
            self._queued.append(request)
            return
        self._dispatch(request)

    def _dispatch(self, request: ClientRequest) -> None:
        # The bench client's clock starts when the request is sent, after its slot is free.
        request.result.start_s = self.loop.now_s
        self._num_in_flight += 1
        if self.mode == "aggregated":
            self._send(self._choose(self.prefill, request), request, request.output_len, None)
        elif (local := self._local_prefill_pick(request)) is not None:
            self.num_local_prefills += 1
            self._send(local, request, request.output_len, None)
        elif self.mode in ("pull", "pull-inline"):
            params = KVTransferParams(do_remote_decode=True, connector="pull")
            self._send(self._choose(self.prefill, request), request, 1, params)
        else:
            self._dispatch_push(request)

    def _local_prefill_pick(self, request: ClientRequest) -> SimInstance | None:
        """The decode instance kv_aware picks, when it lacks at most `local_prefill_tokens`
        of the prompt (the router's `Flows._prefills_locally`); None: prefill on P. One set
        of views serves the peek and the pick: no time passes between them here."""
        if not self.local_prefill_tokens or self.kv_index is None:
            return None
        views, policy = self._views(self.decode, request), self._policies["decode"]
        if uncached_at_pick(policy, views) > self.local_prefill_tokens:
            return None
        return self.decode[policy.choose(views)]

    def _dispatch_push(self, request: ClientRequest) -> None:
        prefill = self._choose(self.prefill, request)
        decode = self._choose(self.decode, request)
        tid = f"t{next(self._transfer_ids)}"
        p_params = KVTransferParams(
            do_remote_decode=True,
            transfer_id=tid,
            remote_engine_id=decode.engine_id,
            connector="push",
        )
        d_params = KVTransferParams(
            do_remote_prefill=True,
            transfer_id=tid,
            remote_engine_id=prefill.engine_id,
            remote_host="sim",
            remote_port=1,
            connector="push",
        )
        self._send(prefill, request, 1, p_params)
        self._send(decode, request, request.output_len, d_params)

    def _choose(self, candidates: list[SimInstance], request: ClientRequest) -> SimInstance:
        role = "decode" if candidates is self.decode else "prefill"
        return candidates[self._policies[role].choose(self._views(candidates, request))]

    def _views(self, candidates: list[SimInstance], request: ClientRequest) -> list[InstanceView]:
        views = [
            InstanceView(
                url=i.engine_id,
                role=i.role,  # type: ignore[arg-type]
                is_healthy=True,
                load=Load(**i.scheduler.load()),
                num_pending=self._num_pending[i.engine_id],
            )
            for i in candidates
        ]
        if self.kv_index is None:
            return views
        self._follow(candidates)
        return with_cached_tokens(self.kv_index, views, request.prompt_token_ids)

    def _follow(self, candidates: list[SimInstance]) -> None:
        """What each instance's cache gained and lost since the index last asked (the wire
        answer of `/kv/events`): the real router asks every poll, the simulator at each choice."""
        assert self.kv_index is not None
        for instance in candidates:
            log = instance.kv_events
            if log is not None:
                answer = log.since(*self.kv_index.cursor(instance.engine_id))
                block_size = instance.scheduler.kv.block_size
                self.kv_index.apply(instance.engine_id, {**answer, "block_size": block_size})

    def _send(
        self,
        instance: SimInstance,
        request: ClientRequest,
        max_tokens: int,
        params: KVTransferParams | None,
    ) -> None:
        """One leg: reaches the instance one hop from now."""
        self._num_pending[instance.engine_id] += 1
        self.cpu.note_request(self.loop.now_s)
        leg = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            kv_transfer_params=params,
            chain_hashes=list(_prompt_hashes(request, instance.scheduler.kv.block_size)),
        )

        def arrive() -> None:
            self._num_pending[instance.engine_id] -= 1
            instance.add_request(leg)

        self.loop.after(self.hop_s, arrive)

    # ------------------------------------------------------------------ outputs

    def _on_outputs(self, instance: SimInstance, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            request = self.requests[output.request_id]
            if instance.role == "prefill":
                self._on_prefill_answer(request, output)
            else:
                self.loop.after(self.hop_s, lambda r=request, o=output: self._to_client(r, o))

    def _on_prefill_answer(self, request: ClientRequest, output: RequestOutput) -> None:
        if output.finish_reason is None:
            return
        request.prefill_breakdown = output.breakdown.to_dict() if output.breakdown else {}
        if output.finish_reason is FinishReason.ERROR:
            self.loop.after(self.hop_s, lambda: self._fail(request, output.error or "prefill"))
        elif self.mode in ("pull", "pull-inline"):
            params = output.kv_transfer_params
            assert params is not None
            # Late binding: D is chosen when P's answer reaches the router, from live load.
            self.loop.after(self.hop_s, lambda: self._send_decode(request, params))

    def _send_decode(self, request: ClientRequest, params: KVTransferParams) -> None:
        self._send(self._choose(self.decode, request), request, request.output_len, params)

    def _to_client(self, request: ClientRequest, output: RequestOutput) -> None:
        now = self.loop.now_s
        result = request.result
        if output.new_token_ids:
            result.token_times_s.append(now)
            self.cpu.note_tokens(now, len(output.new_token_ids))
            if request.output_ids is not None:
                request.output_ids.extend(output.new_token_ids)
        if output.finish_reason is None:
            return
        if output.finish_reason is FinishReason.ERROR:
            self._fail(request, output.error or "error")
            return
        result.output_len = output.num_output_tokens
        decode = output.breakdown.to_dict() if output.breakdown else {}
        result.breakdown = {**request.prefill_breakdown, **decode}  # D's fields win
        self._done(request)

    def _fail(self, request: ClientRequest, reason: str) -> None:
        request.result.error = reason
        self._done(request)

    def _done(self, request: ClientRequest) -> None:
        request.result.end_s = self.loop.now_s
        request.is_done = True
        # Only the result is read from here on: a 10k x 16k-token run would otherwise hold
        # every prompt (gigabytes of ints) to the end.
        request.prompt_token_ids, request.prompt_hashes = [], None
        self._num_in_flight -= 1
        if self._queued:
            self._dispatch(self._queued.popleft())
        if request.on_done is not None:
            request.on_done(request)
