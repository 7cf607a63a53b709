from __future__ import annotations

from disagg.sim.events import EventLoop


def test_events_fire_in_time_order_ties_in_scheduling_order() -> None:
    loop, fired = EventLoop(), []
    loop.at(2.0, lambda: fired.append("late"))
    loop.at(1.0, lambda: fired.append("a"))
    loop.at(1.0, lambda: fired.append("b"))
    loop.at(0.5, lambda: loop.after(0.5, lambda: fired.append("c")))  # scheduled last, t=1.0
    loop.run()
    assert fired == ["a", "b", "c", "late"]
    assert loop.now_s == 2.0
