"""Turning probe answers into records: counters, block use, stage means, down and half-down
instances, the router's own counters. Pure: the answers are built from the real registries."""

from __future__ import annotations

import json

import pytest

from disagg.protocol import TTFTBreakdown
from disagg.status.answer import Answer
from disagg.status.records import RouterRow
from disagg.status.snapshot import (
    STAGES,
    build_cluster,
    build_instance,
    build_router,
    parse_instance_list,
)
from tests.status.fakes import (
    FixedLoadEngine,
    down,
    instance_answers,
    json_answer,
    make_load,
    router_answers,
)

DECODE = RouterRow("http://10.0.0.2:8002", "decode", is_routed=True)
PREFILL = RouterRow("http://10.0.0.1:8001", "prefill", is_routed=True)
STATS = {
    "transfers": 3, "transfers_failed": 1, "expired_leases": 0, "expired_reservations": 2,
    "bytes": 4096, "transfer_s_total": 0.4,
}  # fmt: skip
D_BREAKDOWNS = [
    TTFTBreakdown(handoff_setup_s=0.002, transfer_s=0.1, decode_wait_s=0.01, first_step_s=0.02,
                  loop_blocked_s=0.001, num_bytes=2048, num_reused_tokens=32),
    TTFTBreakdown(handoff_setup_s=0.004, transfer_s=0.3, decode_wait_s=0.03, first_step_s=0.02,
                  loop_blocked_s=0.003, num_bytes=2048, num_reused_tokens=16),
]  # fmt: skip


def decode_engine() -> FixedLoadEngine:
    kv_info = {"role": "decode", "connector": "pull", "transport": "tcp", "stats": STATS}
    return FixedLoadEngine(make_load(running=2, waiting=1, free=40, total=64), kv_info)


def test_decode_instance_counters_blocks_and_stage_means():
    answers = instance_answers(decode_engine(), D_BREAKDOWNS, ["length", "error"])
    inst = build_instance(DECODE, answers)
    assert inst.problems == []
    assert (inst.health, inst.role, inst.connector, inst.transport) == (
        "ok",
        "decode",
        "pull",
        "tcp",
    )
    assert (inst.num_running, inst.num_waiting) == (2, 1)
    assert (inst.num_blocks_used, inst.num_blocks_total) == (24, 64)
    assert inst.blocks_used_fraction == pytest.approx(24 / 64)
    assert (inst.num_handoffs, inst.num_kv_failures, inst.num_expired) == (3, 1, 2)
    assert (inst.num_finished, inst.num_errors) == (2, 1)
    assert inst.stage_means_s == pytest.approx(
        {"handoff_setup": 0.003, "transfer": 0.2, "decode_wait": 0.02, "first_step": 0.02}
    )  # D's stages only: queue and prefill are P's
    assert inst.ttft_mean_s == pytest.approx(0.5)
    assert inst.loop_blocked_s == pytest.approx(0.004)
    assert inst.loop_blocked_mean_s == pytest.approx(0.002)
    assert (inst.num_reused_tokens, inst.num_kv_bytes) == (48, 4096)
    assert inst.num_prefilled_tokens == 0 and inst.cache_hit_fraction is None  # D: no prefill


def test_aggregated_instance_has_no_kv_counters():
    engine = FixedLoadEngine(make_load(), {"role": "both", "model": "m"})
    breakdown = TTFTBreakdown(queue_s=0.01, prefill_s=0.2, num_prefilled_tokens=10)
    inst = build_instance(
        RouterRow("http://h:1", "both", True), instance_answers(engine, [breakdown], ["stop"])
    )
    assert inst.num_handoffs is None and inst.connector is None
    assert inst.stage_means_s == pytest.approx({"queue": 0.01, "prefill": 0.2})
    assert inst.loop_blocked_s is None and inst.num_blocks_used == 0
    # 40 prompt tokens, 10 computed: the prefix cache covered 30 of them
    assert (inst.num_prefilled_tokens, inst.num_cached_tokens) == (10, 30)
    assert inst.cache_hit_fraction == pytest.approx(0.75)
    assert inst.num_kv_bytes is None


def test_a_draining_instance_is_shown_draining_while_it_still_answers():
    rows = parse_instance_list(
        json_answer([{"url": "http://a:1", "role": "both", "healthy": True, "draining": True}])
    )
    assert rows == [RouterRow("http://a:1", "both", True, is_draining=True)]
    engine = FixedLoadEngine(make_load(), {"role": "both", "model": "m"})
    inst = build_instance(rows[0], instance_answers(engine, [], []))
    assert inst.health == "draining" and inst.num_blocks_total is not None
    gone = dict.fromkeys(("/health", "/load", "/kv_info", "/metrics"), down("refused"))
    assert build_instance(rows[0], gone).health == "down"


def test_instance_that_does_not_answer_is_down_with_the_reason():
    answers = dict.fromkeys(("/health", "/load", "/kv_info", "/metrics"), down("timed out"))
    inst = build_instance(DECODE, answers)
    assert inst.health == "down"
    assert inst.problems == ["timed out"]
    assert inst.num_running is None and inst.num_blocks_total is None and inst.stage_means_s == {}


def test_dead_engine_is_unhealthy_but_keeps_what_answered():
    """/health 503 (the engine loop died) while /load still answers: shown, not hidden."""
    answers = instance_answers(decode_engine(), [], [])
    answers["/health"] = json_answer({"status": "engine dead"}, status=503)
    answers["/metrics"] = Answer(200, b"<html>not prometheus</html>")
    inst = build_instance(DECODE, answers)
    assert inst.health == "unhealthy"
    assert inst.num_blocks_total == 64
    assert inst.num_finished is None
    assert any("/metrics" in p and "not Prometheus" in p for p in inst.problems), inst.problems


def test_a_role_the_router_does_not_expect_is_a_problem():
    inst = build_instance(PREFILL, instance_answers(decode_engine(), [], []))
    assert inst.problems == ["the router lists it as prefill, it reports decode"]


def test_router_counts_requests_by_status_and_recomputes():
    answers = router_answers([], ["200", "200", "503"])
    router = build_router("http://r:8000", answers)
    assert (router.health, router.problems) == ("ok", [])
    assert (router.num_requests, router.num_ok, router.num_recomputed) == (3, 2, 1)


def test_router_down_is_unreachable():
    answers = dict.fromkeys(("/health", "/instances", "/metrics"), down())
    router = build_router("http://r:8000", answers)
    assert router.health == "down" and not router.is_reachable
    assert router.problems == ["[Errno 111] Connection refused"]


@pytest.mark.parametrize(
    "body",
    [{"url": "x"}, [{"role": "decode"}], [42]],
    ids=["not-a-list", "no-url", "not-an-object"],
)
def test_instance_list_of_the_wrong_shape_is_refused(body: object):
    with pytest.raises(ValueError, match="/instances"):
        parse_instance_list(json_answer(body))


def test_instance_list_reads_url_role_and_the_routers_health():
    rows = parse_instance_list(
        json_answer([{"url": "http://a:1", "role": "prefill", "healthy": True},
                     {"url": "http://b:2", "role": "decode", "healthy": False}])
    )  # fmt: skip
    assert rows == [
        RouterRow("http://a:1", "prefill", True),
        RouterRow("http://b:2", "decode", False),
    ]


def test_cluster_json_document_is_plain_json():
    rows = [{"url": DECODE.url, "role": "decode", "healthy": True}]
    status = build_cluster(
        "http://r:8000",
        router_answers(rows, ["200"]),
        [(DECODE, instance_answers(decode_engine(), D_BREAKDOWNS, ["length", "length"]))],
        taken_at_s=0.0,
    )
    doc = json.loads(json.dumps(status.to_dict()))
    assert doc["taken_at"] == "1970-01-01T00:00:00Z"
    assert doc["router"]["num_requests"] == 1
    [inst] = doc["instances"]
    assert (inst["url"], inst["role"], inst["num_blocks_total"]) == (DECODE.url, "decode", 64)
    assert inst["stage_means_s"]["transfer"] == pytest.approx(0.2)
    assert inst["num_running"] == 2


def test_stages_follow_the_breakdown_in_critical_path_order():
    assert STAGES == ("queue", "prefill", "handoff_setup", "transfer", "decode_wait", "first_step")
