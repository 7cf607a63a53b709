"""The simulated router: the three flows of `router/flows.py` on the virtual clock, choosing
instances with the real `router/policy.py` from the instances' live `load()`.

- aggregated: one leg to a `both` instance.
- pull: P leg (max_tokens=1, do_remote_decode); D is chosen when P's answer reaches the router
  (late binding) and gets P's kv_transfer_params.
- push: P and D chosen together with a fresh transfer id, both legs sent at once.
Every hop (router -> instance, instance -> router -> client) costs one `http_hop_s`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from disagg.bench.metrics import RequestResult
from disagg.engine.block_pool import hash_blocks
from disagg.engine.request import Request
from disagg.protocol import FinishReason, KVTransferParams, RequestOutput, SamplingParams
from disagg.router.policy import InstanceView, Load, Policy, make_policy
from disagg.sim.events import EventLoop
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
    ) -> None:
        self.mode = mode
        self.prefill = [i for i in instances if i.role in ("prefill", "both")]
        self.decode = [i for i in instances if i.role == "decode"]
        self.loop = loop
        self.hop_s = http_hop_s
        self.max_concurrency = max_concurrency
        self.requests: dict[str, ClientRequest] = {}
        self._policies: dict[str, Policy] = {"prefill": make_policy(policy)}
        self._policies["decode"] = make_policy(policy)
        self._num_pending: dict[str, int] = {i.engine_id: 0 for i in instances}
        self._transfer_ids = itertools.count()
        self._queued: deque[ClientRequest] = deque()  # over max_concurrency
        self._num_in_flight = 0
        for instance in instances:
            instance.on_outputs = self._on_outputs

    # ------------------------------------------------------------------ intake

    def submit(self, request: ClientRequest) -> None:
        """The client sends `request` now."""
        request.result.start_s = self.loop.now_s
        self.requests[request.request_id] = request
        if self.max_concurrency is not None and self._num_in_flight >= self.max_concurrency:
            self._queued.append(request)
            return
        self._dispatch(request)

    def _dispatch(self, request: ClientRequest) -> None:
        self._num_in_flight += 1
        if self.mode == "aggregated":
            self._send(self._choose(self.prefill, "prefill"), request, request.output_len, None)
        elif self.mode in ("pull", "pull-inline"):
            params = KVTransferParams(do_remote_decode=True, connector="pull")
            self._send(self._choose(self.prefill, "prefill"), request, 1, params)
        else:
            self._dispatch_push(request)

    def _dispatch_push(self, request: ClientRequest) -> None:
        prefill = self._choose(self.prefill, "prefill")
        decode = self._choose(self.decode, "decode")
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

    def _choose(self, candidates: list[SimInstance], role: str) -> SimInstance:
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
        return candidates[self._policies[role].choose(views)]

    def _send(
        self,
        instance: SimInstance,
        request: ClientRequest,
        max_tokens: int,
        params: KVTransferParams | None,
    ) -> None:
        """One leg: reaches the instance one hop from now."""
        self._num_pending[instance.engine_id] += 1
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
        self._send(self._choose(self.decode, "decode"), request, request.output_len, params)

    def _to_client(self, request: ClientRequest, output: RequestOutput) -> None:
        now = self.loop.now_s
        result = request.result
        if output.new_token_ids:
            result.token_times_s.append(now)
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
