"""The pure parts of the router's resilience: the circuit breaker's states and the retry budget."""

from __future__ import annotations

import argparse

import pytest

from disagg.config import RouterConfig
from disagg.router import main
from disagg.router.breaker import BreakerState, CircuitBreaker
from disagg.router.retry import RetryBudget


def test_breaker_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(max_failures=3, cooldown_s=10.0)
    breaker.on_failed(0.0)
    breaker.on_failed(0.0)
    breaker.on_served()  # a served leg in between: the count starts again
    assert [breaker.on_failed(1.0) for _ in range(3)] == [False, False, True]
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows(5.0) and breaker.allows(11.0)  # (1) open for the cooldown


def test_breaker_lets_one_probe_through_after_the_cooldown() -> None:
    breaker = CircuitBreaker(max_failures=1, cooldown_s=10.0)
    breaker.on_failed(0.0)
    breaker.on_picked(10.0)  # (1) the probe
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allows(12.0)
    assert breaker.on_failed(12.0)  # (2) it failed: open for another cooldown
    assert not breaker.allows(21.0) and breaker.allows(22.0)
    breaker.on_picked(22.0)
    breaker.on_served()  # (3) it served: closed
    assert breaker.state is BreakerState.CLOSED and breaker.allows(22.0)


def test_a_probe_that_never_reports_lets_another_through_after_a_cooldown() -> None:
    breaker = CircuitBreaker(max_failures=1, cooldown_s=10.0)
    breaker.on_failed(0.0)
    breaker.on_picked(10.0)  # its client left: no outcome ever comes
    assert not breaker.allows(19.0) and breaker.allows(20.0)


def test_a_breaker_with_no_threshold_never_opens() -> None:
    breaker = CircuitBreaker(max_failures=0, cooldown_s=1.0)
    assert not any(breaker.on_failed(float(t)) for t in range(100))
    assert breaker.allows(0.0)


def test_retry_budget_doubles_its_backoff_up_to_the_cap_then_runs_out() -> None:
    budget = RetryBudget(max_retries=4, backoff_s=0.1, max_backoff_s=0.3)
    assert [budget.take() for _ in range(5)] == [0.1, 0.2, 0.3, 0.3, None]
    assert budget.num_retries == 4


def test_resilience_flags_reach_the_router_config() -> None:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    flags = ["--decode", "http://h:1", "--max-retries", "0", "--retry-backoff-s", "0.5"]
    flags += ["--retry-max-backoff-s", "2", "--breaker-failures", "3", "--breaker-cooldown-s", "7"]
    flags += ["--max-concurrent-requests", "8", "--max-queued-requests", "4"]
    cfg = main.build_config(parser.parse_args([*flags, "--queue-timeout-s", "1.5"]))
    assert (cfg.max_retries, cfg.retry_backoff_s, cfg.retry_max_backoff_s) == (0, 0.5, 2.0)
    assert (cfg.breaker_failures, cfg.breaker_cooldown_s) == (3, 7.0)
    assert (cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.queue_timeout_s) == (
        8, 4, 1.5,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_retries", -1), ("retry_backoff_s", 0), ("retry_max_backoff_s", 0.01),
     ("breaker_failures", -1), ("breaker_cooldown_s", 0), ("max_concurrent_requests", -1),
     ("max_queued_requests", -1), ("queue_timeout_s", 0)],
)  # fmt: skip
def test_bad_resilience_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(decode_urls=("http://h:1",), **{field: value})
