"""The simulated model runner: a token for every request whose chunk ends its sequence, and
the step's duration from the cost model. Holds no state between steps (as the real runner)."""

from __future__ import annotations

from disagg.engine.outputs import RunnerOutput, SchedulerOutput
from disagg.sim.cost import CostModel, StepShape

__all__ = ["SimRunner"]

SAMPLED_TOKEN_ID = 7  # any id that is not a stop token; outputs run to max_tokens (ignore_eos)


class SimRunner:
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def duration_s(self, sched: SchedulerOutput) -> float:
        """The model step, plus serving each sampled token where that holds up the loop."""
        batch = [StepShape(len(s.token_ids), s.start_pos, s.do_sample) for s in sched.requests]
        num_sampled = sum(1 for s in sched.requests if s.do_sample)
        return self.cost.step_s(batch) + num_sampled * self.cost.hardware.output_token_s

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(
            sampled_token_ids={
                s.request_id: SAMPLED_TOKEN_ID for s in sched.requests if s.do_sample
            }
        )
