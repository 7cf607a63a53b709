"""A circuit breaker per instance: after `max_failures` legs in a row that the instance did not
serve it takes no work for `cooldown_s`; then one leg probes it (half-open), and served closes
the breaker again while failed opens it for another cooldown.

Pure: time is passed in. Must not decide what a failure is (legs.py) nor pick instances.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.Enum):
    CLOSED = "closed"  # takes work
    OPEN = "open"  # takes none until `until_s`
    HALF_OPEN = "half_open"  # one probe is out; another only if it never reports by `until_s`


@dataclass(slots=True)
class CircuitBreaker:
    max_failures: int  # consecutive failures that open it; 0 = it never opens
    cooldown_s: float  # open -> probe after this long; also a silent probe's deadline
    state: BreakerState = BreakerState.CLOSED
    num_failures: int = 0  # consecutive, since the instance last served a leg
    until_s: float = 0.0  # monotonic; OPEN: no leg before; HALF_OPEN: the probe's deadline

    def allows(self, now_s: float) -> bool:
        """May a leg go to the instance now? Does not mutate."""
        return self.state is BreakerState.CLOSED or now_s >= self.until_s

    def on_picked(self, now_s: float) -> None:
        """A leg was sent its way. Past the cooldown, that leg is the probe: until it reports
        (or a cooldown passes, if it never does: its client left) no other follows it."""
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.HALF_OPEN
            self.until_s = now_s + self.cooldown_s

    def on_served(self) -> None:
        self.state = BreakerState.CLOSED
        self.num_failures = 0

    def on_failed(self, now_s: float) -> bool:
        """A leg the instance did not serve. True when this failure opens the breaker."""
        self.num_failures += 1
        is_tripped = self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED
            and self.max_failures > 0
            and self.num_failures >= self.max_failures
        )
        if is_tripped:
            self.state = BreakerState.OPEN
            self.until_s = now_s + self.cooldown_s
        return is_tripped
