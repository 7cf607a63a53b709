"""Co-location (sim/host_cpu.py): processor sharing of a small host's cores among the engine
steps and the serving work around them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from disagg.sim.events import EventLoop
from disagg.sim.host_cpu import CpuShare, HostCpu
from tests.sim.helpers import make_config, simulate

_HOST = HostCpu(num_cores=2, token_cpu_s=1e-3, request_cpu_s=2e-3)


def _ends(cpu: CpuShare, loop: EventLoop, works: list[tuple[float, float]]) -> list[float]:
    """Steps of (start time, CPU-seconds) on `cpu`: the virtual time each one ends."""
    ended: list[float] = [0.0] * len(works)
    for i, (start_s, work_s) in enumerate(works):

        def start(i: int = i, work_s: float = work_s) -> None:
            cpu.run(work_s, lambda: ended.__setitem__(i, loop.now_s))

        loop.at(start_s, start)
    loop.run()
    return ended


def test_no_host_no_sharing() -> None:
    loop = EventLoop()
    assert _ends(CpuShare(loop, None), loop, [(0.0, 1.0)] * 3) == [1.0] * 3


def test_engines_share_the_cores() -> None:
    """Three 1 s steps on two cores: each runs at 2/3 while all three run."""
    loop = EventLoop()
    cpu = CpuShare(loop, _HOST)
    assert _ends(cpu, loop, [(0.0, 1.0)] * 3) == pytest.approx([1.5] * 3)
    assert cpu.max_slowdown == pytest.approx(1.5) and cpu.num_running == 0


def test_a_long_step_is_slowed_only_while_others_run() -> None:
    """One core: a 2 s step shares it with a 0.5 s step started at 1 s (each at half speed
    from 1 s to 2 s), then runs alone again: it ends at 2.5 s, the short one at 2 s."""
    loop = EventLoop()
    one = HostCpu(num_cores=1, token_cpu_s=0.0, request_cpu_s=0.0)
    assert _ends(CpuShare(loop, one), loop, [(0.0, 2.0), (1.0, 0.5)]) == pytest.approx([2.5, 2.0])


def test_serving_work_counts_over_its_window_then_is_forgotten() -> None:
    loop = EventLoop()
    cpu = CpuShare(loop, _HOST, window_s=0.5)
    cpu.note_tokens(0.0, 1000)  # 1 CPU-second of relay and client work in half a second
    cpu.note_request(0.0)
    (ended,) = _ends(cpu, loop, [(0.1, 0.1)])
    assert ended == pytest.approx(0.1 + 0.1 * (1 + 1.002 / 0.5) / 2)
    (alone,) = _ends(cpu, loop, [(5.0, 0.1)])  # the work is long out of the window
    assert alone == pytest.approx(5.1)


def test_host_figures_are_checked() -> None:
    with pytest.raises(ValueError, match="num_cores"):
        HostCpu(num_cores=0, token_cpu_s=0.0, request_cpu_s=0.0)
    with pytest.raises(ValueError, match="CPU costs"):
        HostCpu(num_cores=2, token_cpu_s=-1.0, request_cpu_s=0.0)


def _profile_with_host(tmp_path: Path, num_cores: int) -> str:
    """cpu-dev's figures with a [host] of `num_cores` cores and some serving work (0: none)."""
    from disagg.sim.hardware import _PROFILE_DIR

    text = (_PROFILE_DIR / "cpu-dev.toml").read_text().split("[host]")[0]  # its own, if any
    if num_cores:
        text += f"\n[host]\nnum_cores = {num_cores}\ntoken_cpu_s = 5e-4\nrequest_cpu_s = 1e-3\n"
        text += "loop_request_cpu_s = 5e-4\n"
    path = tmp_path / f"host{num_cores}.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("mode", ["aggregated", "pull", "push"])
def test_a_crowded_host_stretches_steps(tmp_path: Path, mode: str) -> None:
    """The same run on one shared core takes longer than on plenty: P's prefills and D's
    decodes (or two aggregated instances) wait for the core in turn."""
    base = make_config(mode, model="SmolLM2-135M", num_prompts=12, request_rate=4.0,
                       input_len=128, output_len=64,
                       num_decode=2 if mode == "aggregated" else 1)  # fmt: skip
    crowded, _ = simulate(replace(base, hardware=_profile_with_host(tmp_path, 1)))
    roomy, _ = simulate(replace(base, hardware=_profile_with_host(tmp_path, 64)))
    alone, _ = simulate(replace(base, hardware=_profile_with_host(tmp_path, 0)))
    # plenty of cores: as without [host] (push's registrations still cost P's loop a little)
    assert roomy["median_e2el_ms"] == pytest.approx(alone["median_e2el_ms"], rel=0.01)
    assert crowded["median_e2el_ms"] > 1.5 * roomy["median_e2el_ms"]
    assert crowded["sim"]["max_cpu_slowdown"] > 1.0 == roomy["sim"]["max_cpu_slowdown"]
