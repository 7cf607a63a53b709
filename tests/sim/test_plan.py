from __future__ import annotations

import argparse
import re
from dataclasses import replace

import pytest

from disagg.cli import main
from disagg.sim import plan as plan_command
from disagg.sim.plan import by_gpu_count, candidates, format_rows, plan
from tests.sim.helpers import make_config


def test_candidates_cover_every_split() -> None:
    configs = candidates(make_config(), ["pull", "aggregated"], 3)
    splits = sorted((c.mode, c.num_prefill, c.num_decode) for c in configs)
    assert splits == [("aggregated", 3, 0), ("pull", 1, 2), ("pull", 2, 1)]
    assert all(c.num_instances == 3 for c in configs)


def test_plan_stops_at_the_cheapest_gpu_count_that_meets_the_slos() -> None:
    base = replace(
        make_config(num_prompts=8, input_len=256, output_len=8, request_rate=2.0),
        goodput_slos_ms={"ttft": 200.0, "tpot": 50.0},
    )
    rows = plan(base, ["push", "aggregated"], max_gpus=4, attainment=0.9)
    met = [r for r in rows if r.attainment >= 0.9]
    assert met and min(r.num_gpus for r in met) == max(r.num_gpus for r in rows)
    assert format_rows(rows, 0.9).splitlines()[2].endswith("| yes |")


def test_plan_tries_every_size_when_nothing_meets() -> None:
    base = replace(make_config(num_prompts=4), goodput_slos_ms={"ttft": 0.001, "tpot": 0.001})
    rows = plan(base, ["pull"], max_gpus=3, attainment=0.9)
    assert {r.config.num_instances for r in rows} == {2, 3}
    assert all(r.attainment == 0 for r in rows)


def test_tp_search_groups_by_gpu_count_and_skips_tps_that_do_not_fit() -> None:
    # Llama-3-70B's bf16 weights (~141 GB) overflow one H200 (141 GB x 0.9 usable): tp=1 is out.
    base = make_config(model="Llama-3-70B")
    groups = by_gpu_count(base, ["push", "aggregated"], tps=[1, 2, 4], max_gpus=8)
    assert [gpus for gpus, _ in groups] == [2, 4, 6, 8]
    for gpus, configs in groups:
        assert all(c.num_gpus == gpus and c.tp in (2, 4) for c in configs)
    eight = {(c.mode, c.tp, c.num_prefill, c.num_decode) for c in dict(groups)[8]}
    assert ("push", 4, 1, 1) in eight and ("push", 2, 1, 3) in eight


def test_plan_reports_the_tp_of_each_row() -> None:
    base = replace(
        make_config(num_prompts=6, input_len=256, output_len=8, request_rate=2.0),
        goodput_slos_ms={"ttft": 0.001, "tpot": 0.001},  # nothing meets: every size is tried
    )
    rows = plan(base, ["push"], max_gpus=4, attainment=0.9, tps=[1, 2])
    assert {(r.config.tp, r.num_gpus) for r in rows} == {(1, 2), (1, 3), (1, 4), (2, 4)}
    assert "| TP |" in format_rows(rows, 0.9).splitlines()[0]


# The workload of test_plan_stops_at_the_cheapest_gpu_count_that_meets_the_slos, as flags.
_SIM_FLAGS = ["sim", "--num-prompts", "8", "--input-len", "256", "--output-len", "8",
              "--request-rate", "2", "--model", "Qwen3-8B", "--num-blocks", "2048"]  # fmt: skip


def test_plan_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: --slo-ttft-ms, --slo-tpot-ms, --max-gpus and --modes had no help at all."""
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    assert all(action.help for action in parser._actions), "a flag without help"
    with pytest.raises(SystemExit):
        main(["sim", "plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--slo-ttft-ms MS .*time to first token.* ms", text), text
    assert re.search(r"--slo-tpot-ms MS .*time per output token.* ms", text), text
    assert re.search(r"--max-gpus N .*\(default: 8\)", text), text
    assert re.search(r"--modes MODES .*\(default: pull,push,aggregated\)", text), text


def test_plan_names_the_cheapest_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*_SIM_FLAGS, "plan", "--slo-ttft-ms", "200", "--slo-tpot-ms", "50"]
    assert main([*argv, "--max-gpus", "4", "--modes", "push,aggregated"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    found = re.fullmatch(
        r"cheapest meeting the SLO: (push|aggregated), (.+) at TP 1 "
        r"\((\d+) GPUs?, (\d+)% of requests within SLO\)",
        lines[-1],
    )
    assert found, lines[-1]
    best = [cell.strip() for cell in lines[2].split("|")]  # the table's first row is the cheapest
    assert best[-2] == "yes" and (best[1], best[5], best[6]) == (
        found.group(1), found.group(3), found.group(4) + "%"
    )  # fmt: skip


def test_plan_says_when_nothing_meets_the_slo(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*_SIM_FLAGS, "plan", "--slo-ttft-ms", "0.001", "--slo-tpot-ms", "0.001"]
    assert main([*argv, "--max-gpus", "3", "--modes", "pull"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("no deployment meets the SLO within 3 GPUs"), last
    # Every deployment has 0% within SLO: the closest is then the one with the fewest GPUs.
    assert last.endswith("closest: pull, 1 prefill + 1 decode at TP 1 (2 GPUs, 0% of requests "
                         "within SLO)"), last  # fmt: skip
