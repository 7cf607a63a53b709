"""merge_profiles: one CPU profile from several calibrations, each figure their median."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.sim.hardware import _PROFILE_DIR, load_profile
from disagg.sim.merge_profiles import main, merge


def test_each_figure_is_the_median() -> None:
    profiles = [{"name": "x", "engine": {"step_s": v, "on": True}, "cores": c}
                for v, c in ((3.0, 2), (1.0, 2), (2.0, 4))]  # fmt: skip
    assert merge(profiles) == {"name": "x", "engine": {"step_s": 2.0, "on": True}, "cores": 2}
    with pytest.raises(ValueError, match="disagree"):
        merge([{"on": True}, {"on": False}])


def test_merged_profile_loads(tmp_path: Path) -> None:
    """Three calibrations differing in one figure: the merged one loads, with their median
    there and every other figure as it was."""
    source = (_PROFILE_DIR / "cpu-dev.toml").read_text().splitlines()
    paths = []
    for i in range(3):
        path = tmp_path / f"c{i}.toml"
        changed = f"step_overhead_s = {i + 1}e-3"
        lines = [changed if line.startswith("step_overhead_s") else line for line in source]
        path.write_text("\n".join(lines))
        paths.append(path)
    out = tmp_path / "merged.toml"
    assert main([*map(str, paths), "--name", "merged", "--out", str(out)]) == 0
    merged, original = load_profile(str(out)), load_profile("cpu-dev")
    assert merged.name == "merged" and merged.step_overhead_s == pytest.approx(2e-3)
    assert merged.fitted_step == original.fitted_step and merged.host == original.host
