"""Co-location: the cores every process of a one-host deployment shares, as processor sharing.

On a small CPU host the engine steps of all instances, each instance's event loop (parse,
detokenize, SSE), the router's relay and the benchmark client run on the same few cores. While
more of that work is runnable than there are cores, every runnable engine step advances at
cores / (steps running + serving work in cores): each step is a job of CPU work, and its end is
rescheduled whenever the set of running steps changes. The serving work around the engines is
counted in cores: the CPU it costs per streamed token and per request (router + client + the
instances' loops, measured by `disagg sim calibrate`) times the rates seen over the last
`window_s` of virtual time. A profile without `[host]` (a GPU host: its CPUs are many and
idle) shares nothing: a step takes its work's time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from disagg.sim.events import EventLoop

__all__ = ["CpuShare", "HostCpu"]

# ASSUMPTION, not fitted: the serving work seen over this much virtual time sets the load the
# running steps share the cores with (a token's relay and the client's parse land within ~ITL).
WINDOW_S = 0.5
_DONE_S = 1e-12  # work left below this is done (float rounding)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCpu:
    """A profile's `[host]` section (all measured by `disagg sim calibrate`)."""

    num_cores: int  # cores the deployment's processes share
    token_cpu_s: float  # CPU-seconds per streamed token outside the engine threads
    request_cpu_s: float  # CPU-seconds per request outside the engine threads
    # Of a request's, what an instance's own event loop spends on one signed call: a push
    # registration reaching P's loop while P prefills shares P's interpreter with its engine.
    loop_request_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_cores < 1:
            raise ValueError(f"host.num_cores must be >= 1, got {self.num_cores}")
        if min(self.token_cpu_s, self.request_cpu_s, self.loop_request_cpu_s) < 0:
            raise ValueError("host CPU costs must be >= 0")


@dataclass(slots=True)
class _Step:
    work_s: float  # CPU-seconds left
    on_done: Callable[[], None]


class CpuShare:
    """The engine steps running on one host and the serving work around them."""

    def __init__(self, loop: EventLoop, host: HostCpu | None, window_s: float = WINDOW_S) -> None:
        self.loop = loop
        self.host = host
        self.window_s = window_s
        self.max_slowdown = 1.0  # 1 / the slowest rate any step ran at (reported by the run)
        self._steps: list[_Step] = []
        self._rate = 1.0  # CPU-seconds each running step gets per second, now
        self._since_s = 0.0  # when the running steps' work was last brought up to date
        self._version = 0  # the one end-of-step event that is still current
        self._work: deque[tuple[float, float]] = deque()  # (time, CPU-seconds) of serving work
        self._work_s = 0.0  # sum of _work

    @property
    def num_running(self) -> int:
        return len(self._steps)

    def run(self, work_s: float, on_done: Callable[[], None]) -> None:
        """An engine step of `work_s` CPU-seconds starts now; `on_done` runs when it ends."""
        if self.host is None or work_s <= 0:
            self.loop.after(work_s, on_done)
            return
        self._catch_up()
        self._steps.append(_Step(work_s, on_done))
        self._reschedule()

    def note_tokens(self, now_s: float, num_tokens: int) -> None:
        """Tokens streamed to clients: the relay, detokenize and client work they cost."""
        if self.host is not None and num_tokens:
            self._add(now_s, num_tokens * self.host.token_cpu_s)

    def note_request(self, now_s: float) -> None:
        if self.host is not None:
            self._add(now_s, self.host.request_cpu_s)

    # ------------------------------------------------------------------ processor sharing

    def _catch_up(self) -> None:
        """Charge the running steps the work they did since `_since_s`, at `_rate`."""
        now_s = self.loop.now_s
        done_s = (now_s - self._since_s) * self._rate
        for step in self._steps:
            step.work_s -= done_s
        self._since_s = now_s

    def _reschedule(self) -> None:
        """The rate for the steps running now, and the event for the first to end."""
        assert self.host is not None
        self._version += 1
        if not self._steps:
            self._rate = 1.0
            return
        self._forget(self.loop.now_s)
        demand = len(self._steps) + self._work_s / self.window_s
        self._rate = min(1.0, self.host.num_cores / demand)
        self.max_slowdown = max(self.max_slowdown, 1.0 / self._rate)
        left_s = max(0.0, min(step.work_s for step in self._steps))
        version = self._version
        self.loop.after(left_s / self._rate, lambda: self._on_end(version))

    def _on_end(self, version: int) -> None:
        if version != self._version:  # the running set changed since: a newer event stands
            return
        self._catch_up()
        ended = [step for step in self._steps if step.work_s <= _DONE_S]
        self._steps = [step for step in self._steps if step.work_s > _DONE_S]
        self._reschedule()
        for step in ended:
            step.on_done()

    # ------------------------------------------------------------------ serving work

    def _add(self, now_s: float, cpu_s: float) -> None:
        self._work.append((now_s, cpu_s))
        self._work_s += cpu_s
        self._forget(now_s)

    def _forget(self, now_s: float) -> None:
        while self._work and self._work[0][0] < now_s - self.window_s:
            self._work_s -= self._work.popleft()[1]
        self._work_s = max(self._work_s, 0.0)  # float drift
