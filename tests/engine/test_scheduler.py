"""Scheduler lifecycles, each ending with every block free (assert_no_leaks)."""

from disagg.engine.request import RequestStatus
from tests.fakes import (
    FakeConnector,
    FakeRunner,
    assert_no_leaks,
    drain,
    make_request,
    make_scheduler,
    run_step,
)


def test_single_request_prefill_then_decode():
    sched, req = make_scheduler(), make_request(num_tokens=10, max_tokens=3)
    sched.add_request(req)
    out, outputs = run_step(sched, FakeRunner())  # (1) whole prompt in one chunk
    assert out.num_scheduled_tokens == 10 and outputs[0].new_token_ids == [7]
    out, outputs = run_step(sched, FakeRunner())  # (2) one decode token
    assert out.num_scheduled_tokens == 1 and out.requests[0].start_pos == 10
    outputs += drain(sched, FakeRunner())
    assert outputs[-1].finish_reason.value == "length" and req.output_token_ids == [7, 7, 7]
    assert_no_leaks(sched)


def test_chunked_prefill_respects_the_token_budget():
    sched, req = make_scheduler(max_num_batched_tokens=8), make_request(num_tokens=20, max_tokens=1)
    sched.add_request(req)
    chunks = []
    for _ in range(3):
        out, _ = run_step(sched, FakeRunner())
        chunks.append((out.requests[0].start_pos, len(out.requests[0].token_ids)))
        assert out.requests[0].do_sample == (chunks[-1][0] + chunks[-1][1] == 20)
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    assert_no_leaks(sched)


def test_continuous_batching_mixes_decodes_and_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=16)
    a = make_request(num_tokens=6, max_tokens=5)
    sched.add_request(a)
    run_step(sched, FakeRunner())
    b = make_request(prompt=list(range(100, 109)), max_tokens=2)
    sched.add_request(b)
    out, _ = run_step(sched, FakeRunner())
    sizes = {s.request_id: len(s.token_ids) for s in out.requests}
    assert sizes == {a.request_id: 1, b.request_id: 9}
    assert [len(s.token_ids) for s in out.requests] == [9, 1]  # prefills first
    drain(sched, FakeRunner())
    assert_no_leaks(sched)


def test_eos_and_stop_token_ids_finish():
    sched = make_scheduler(eos_token_ids=(7,))
    req = make_request(max_tokens=10)
    sched.add_request(req)
    _, outputs = run_step(sched, FakeRunner(token=7))
    assert outputs[0].finish_reason.value == "stop"
    ignore = make_request(max_tokens=3, ignore_eos=True)
    sched.add_request(ignore)
    drain(sched, FakeRunner(token=7))
    assert ignore.output_token_ids == [7, 7, 7]
    stop = make_request(max_tokens=10, stop_token_ids=(5,))
    sched.add_request(stop)
    drain(sched, FakeRunner(token=5))
    assert stop.finish_status is RequestStatus.FINISHED_STOPPED
    assert_no_leaks(sched)


def test_prefix_cache_hit_skips_cached_blocks():
    sched = make_scheduler(block_size=4)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks cacheable
    first = make_request(prompt=prompt, max_tokens=1)
    sched.add_request(first)
    drain(sched, FakeRunner())
    second = make_request(prompt=prompt, max_tokens=1)
    sched.add_request(second)
    out, outputs = run_step(sched, FakeRunner())
    assert out.requests[0].start_pos == 16 and len(out.requests[0].token_ids) == 1
    assert outputs[0].num_cached_tokens == 16
    assert_no_leaks(sched)


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b = make_request(num_tokens=8, max_tokens=8), make_request(num_tokens=8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, FakeRunner())  # both prefilled: 4 blocks used
    preempted = False
    for _ in range(40):
        if not sched.has_unfinished:
            break
        run_step(sched, FakeRunner())
        preempted |= sched.num_preemptions > 0
    assert preempted
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert_no_leaks(sched)


def test_abort_waiting_and_running():
    sched = make_scheduler()
    a, b = make_request(max_tokens=50), make_request(max_tokens=50)
    sched.add_request(a)
    assert sched.abort(a.request_id, 0.0)
    sched.add_request(b)
    run_step(sched, FakeRunner())
    assert sched.abort(b.request_id, 0.0)
    assert not sched.abort(b.request_id, 0.0)
    out, outputs = run_step(sched, FakeRunner())
    assert b.request_id in out.finished_req_ids
    assert_no_leaks(sched)


def test_prefill_then_remote_decode_holds_blocks_until_sent():
    connector = FakeConnector(delay=2)
    sched = make_scheduler(connector=connector)
    req = make_request(num_tokens=10, max_tokens=1, remote_decode=True)
    sched.add_request(req)
    _, outputs = run_step(sched, FakeRunner(), connector)  # (1) prefill + first token
    assert outputs[0].finish_reason.value == "length"
    assert outputs[0].kv_transfer_params.remote_block_ids == req.block_ids
    assert req.status is RequestStatus.WAITING_FOR_KV_SEND
    assert sched.block_pool.num_used_blocks == 3  # held for the decode instance
    drain(sched, FakeRunner(), connector)  # (2) transfer done -> freed
    assert_no_leaks(sched)


def test_remote_prefill_waits_for_kv_then_decodes_with_carried_token():
    connector = FakeConnector(delay=3)
    sched = make_scheduler(connector=connector)
    req = make_request(num_tokens=10, max_tokens=3, remote_prefill=True, first_token_id=42)
    sched.add_request(req)
    out, outputs = run_step(sched, FakeRunner(), connector)  # (1) blocks reserved
    assert out.is_empty and req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(req.block_ids) == 3  # ceil((10 + 1) / 4)
    outputs = drain(sched, FakeRunner(), connector)  # (2) KV lands, decode resumes
    assert req.output_token_ids == [42, 7, 7]
    assert outputs[0].new_token_ids == [42]
    assert_no_leaks(sched)


def test_failed_remote_kv_is_an_error_or_recompute():
    failed = make_request(remote_prefill=True, request_id="f")
    connector = FakeConnector(delay=1, fail={"f"})
    sched = make_scheduler(connector=connector)
    sched.add_request(failed)
    outputs = drain(sched, FakeRunner(), connector)
    assert outputs[-1].finish_reason.value == "error" and outputs[-1].error == "injected failure"
    assert_no_leaks(sched)


def test_abort_during_in_flight_transfer_keeps_blocks_until_settled():
    connector = FakeConnector(delay=5)
    connector.in_flight_on_abort = True
    sched = make_scheduler(connector=connector)
    req = make_request(num_tokens=10, remote_prefill=True, first_token_id=3)
    sched.add_request(req)
    run_step(sched, FakeRunner(), connector)
    assert sched.abort(req.request_id, 0.0)
    assert sched.block_pool.num_used_blocks == 3  # a write may still land: not reusable
    drain(sched, FakeRunner(), connector)
    assert_no_leaks(sched)


def test_load_snapshot():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request(num_tokens=20, max_tokens=1))
    sched.add_request(make_request(num_tokens=5, max_tokens=1))
    assert sched.load()["num_queued_prefill_tokens"] == 25
    run_step(sched, FakeRunner())
    load = sched.load()
    assert load["num_running"] == 1 and load["num_waiting"] == 1
    assert load["num_queued_prefill_tokens"] == 12 + 5  # what is left of A, all of B
    assert set(load) == {
        "num_running",
        "num_waiting",
        "num_free_blocks",
        "num_total_blocks",
        "num_queued_prefill_tokens",
        "num_queued_uncached_tokens",
    }


def test_load_counts_queued_tokens_a_cached_prefix_covers_apart():
    """kv_aware weighs an instance's queue: a queued turn whose history the cache holds is
    little work, and the load says so (the plain queued-token count is unchanged)."""
    sched = make_scheduler(max_num_batched_tokens=64)  # block size 4 (the fakes')
    history = list(range(100, 132))  # 8 full blocks
    sched.add_request(make_request(prompt=history, max_tokens=1))
    drain(sched, FakeRunner())  # computed and cached, then freed (cached-free)
    sched.add_request(make_request(prompt=[*history, 7, 8, 9], max_tokens=1))
    sched.add_request(make_request(prompt=list(range(500, 520)), max_tokens=1))
    load = sched.load()
    assert load["num_queued_prefill_tokens"] == 35 + 20
    assert load["num_queued_uncached_tokens"] == 3 + 20  # 32 of the first are cached
    drain(sched, FakeRunner())
    assert sched.load()["num_queued_uncached_tokens"] == 0
    assert_no_leaks(sched)


def test_a_decode_side_request_is_not_hashed_for_the_estimate():
    """Its KV comes from a prefill instance and is never matched here: estimating its cache
    hit would put a SHA-256 pass over every prompt on the decode loop for nothing."""
    sched = make_scheduler()
    request = make_request(num_tokens=40, remote_prefill=True, first_token_id=1)
    sched.add_request(request)
    assert request.chain_hashes == [] and request.queued_uncached_tokens == 40
