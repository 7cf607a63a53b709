"""One client request's retry budget: how many more times a leg that never reached its instance
may be sent again, and how long to wait first (exponential backoff, capped).

Pure: it counts and computes waits; legs.py sleeps and resends. Must not decide what may be
retried (only legs that never reached an instance, before any byte went to the client).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import RouterConfig

__all__ = ["RetryBudget"]


@dataclass(slots=True)
class RetryBudget:
    max_retries: int  # per client request, over all its legs
    backoff_s: float  # the wait before the first retry; doubled for each one after
    max_backoff_s: float
    num_retries: int = 0  # spent so far

    @classmethod
    def of(cls, cfg: RouterConfig) -> RetryBudget:
        return cls(cfg.max_retries, cfg.retry_backoff_s, cfg.retry_max_backoff_s)

    def take(self) -> float | None:
        """Spend one retry: the seconds to wait before it, or None once the budget is spent."""
        if self.num_retries >= self.max_retries:
            return None
        wait_s = min(self.backoff_s * 2**self.num_retries, self.max_backoff_s)
        self.num_retries += 1
        return wait_s
