"""Drawing a snapshot: table alignment, the cells of a busy, a down and an unrouted instance,
the problems listed under the tables, width cutting and colour only on request."""

from __future__ import annotations

from disagg.status.records import ClusterStatus, InstanceStatus, RouterStatus
from disagg.status.screen import format_table, render

ROUTER = RouterStatus(url="http://r:8000", health="ok", num_requests=7, num_ok=6, num_recomputed=1)
DECODE = InstanceStatus(
    url="http://d:8002", role="decode", health="ok", is_routed=True, connector="pull",
    transport="tcp", num_running=2, num_waiting=1, num_blocks_used=24, num_blocks_total=64,
    num_handoffs=3, num_kv_failures=1, num_expired=0, num_finished=5, num_errors=0,
    ttft_mean_s=0.5, stage_means_s={"transfer": 0.2, "first_step": 0.0125},
    loop_blocked_s=0.004, loop_blocked_mean_s=0.002, num_prefilled_tokens=30,
    num_cached_tokens=90, num_reused_tokens=480, num_kv_bytes=3 * 2**20,
)  # fmt: skip
DOWN = InstanceStatus(
    url="http://p:8001", role="prefill", health="down", is_routed=False,
    problems=["[Errno 111] Connection refused"],
)  # fmt: skip


def cluster(*instances: InstanceStatus, router: RouterStatus = ROUTER) -> ClusterStatus:
    return ClusterStatus(router=router, instances=list(instances), taken_at_s=0.0)


def _row(screen: str, url: str, *, table: int) -> list[str]:
    """The cells of `url`'s row in the load table (0) or the stage table (1)."""
    rows = [line for line in screen.splitlines() if line.startswith(url)]
    return rows[table].split()


def test_format_table_pads_names_left_and_numbers_right():
    lines = format_table(["NAME", "N"], [["a", "1"], ["long-name", "123"]])
    assert lines == ["NAME         N", "a            1", "long-name  123"]


def test_busy_instance_shows_load_blocks_handoffs_and_stage_means_in_ms():
    screen = render(cluster(DECODE))
    assert "requests 7 (6 ok, 1 recomputed)" in screen.splitlines()[0]
    load = _row(screen, "d:8002", table=0)
    assert load == ["d:8002", "decode", "ok", "pull/tcp", "2", "1", "24/64", "38%", "3", "1", "0",
                    "5", "0"]  # fmt: skip
    stages = _row(screen, "d:8002", table=1)
    # queue, prefill, handoff_setup: not on D's path; transfer; decode_wait; first_step; TTFT
    assert stages[:8] == ["d:8002", "-", "-", "-", "200.0", "-", "12.5", "500.0"]
    assert "0.004s (2.00 ms each)" in screen
    cache = _row(screen, "d:8002", table=2)
    assert cache == ["d:8002", "30", "90", "75%", "480", "3.0", "MiB"]
    assert "problems" not in screen


def test_down_instance_is_shown_down_with_its_reason_and_empty_cells():
    screen = render(cluster(DECODE, DOWN))
    assert _row(screen, "p:8001", table=0)[:5] == ["p:8001", "prefill", "down", "-", "-"]
    assert "p:8001  [Errno 111] Connection refused" in screen.split("problems:")[1]


def test_instance_the_router_does_not_route_to_is_marked():
    unrouted = InstanceStatus(url="http://d:9", role="decode", health="ok", is_routed=False)
    screen = render(cluster(unrouted))
    assert _row(screen, "d:9", table=0)[2] == "ok*"
    assert "router does not send it requests" in screen


def test_router_down_says_so_instead_of_an_empty_table():
    router = RouterStatus(url="http://r:8000", health="down", problems=["timed out"])
    screen = render(cluster(router=router))
    assert "DOWN" in screen.splitlines()[0]
    assert "the router did not answer" in screen
    assert "INSTANCE" not in screen


def test_width_cuts_every_line_and_colour_is_opt_in():
    assert "\x1b[" not in render(cluster(DECODE, DOWN))
    coloured = render(cluster(DECODE, DOWN), width=40, color=True)
    assert "\x1b[31m" in coloured  # the down row and its problem in red
    plain = render(cluster(DECODE, DOWN), width=40)
    assert max(len(line) for line in plain.splitlines()) == 40


def test_live_screen_fits_the_terminal_and_names_the_quit_key():
    many = [InstanceStatus(url=f"http://d:{i}", role="decode", health="ok", is_routed=True)
            for i in range(30)]  # fmt: skip
    screen = render(cluster(*many), interval_s=2.0, width=80, height=24, color=True)
    assert len(screen.splitlines()) == 24
    assert "every 2s, q quits" in screen.splitlines()[0]
    assert "q quits" not in render(cluster(*many), interval_s=2.0)  # piped: no keys to press
