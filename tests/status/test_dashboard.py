"""The Grafana dashboard (deploy/grafana/disagg.json) queries only what the servers export.

The exported names come from the real registries (`ServerMetrics` with every KV connector
counter, `RouterMetrics`), expanded the way Prometheus sees them: a counter `x` is `x_total`, a
histogram `h` is `h_bucket`, `h_sum`, `h_count`. The status view's names are held to the same.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from disagg.kv.common import _STAT_NAMES
from disagg.protocol import TTFTBreakdown
from disagg.router.metrics import RouterMetrics
from disagg.server.metrics import ServerMetrics
from disagg.status.snapshot import METRIC_NAMES, STAGES
from tests.status.fakes import FixedLoadEngine, make_load

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "disagg.json"
_METRIC = re.compile(r"\bdisagg_[a-z0-9_]+\b")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _registries() -> list[CollectorRegistry]:
    """Both registries, with every connector counter present (they appear once counted)."""
    stats = dict.fromkeys(_STAT_NAMES, 0)
    engine = FixedLoadEngine(make_load(), {"role": "decode", "connector": "pull", "stats": stats})
    return [ServerMetrics(engine).registry, RouterMetrics().registry]  # type: ignore[arg-type]


def exported_names() -> dict[str, set[str]]:
    """Sample name as Prometheus stores it -> the family types that export it."""
    names: dict[str, set[str]] = defaultdict(set)
    for registry in _registries():
        for family in registry.collect():
            for suffix in _SUFFIXES[family.type]:
                names[f"{family.name}{suffix}"].add(family.type)
    return dict(names)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(node: Any) -> list[str]:
    """Every PromQL string in the dashboard: panel targets and variable queries."""
    if isinstance(node, list):
        return [q for item in node for q in _queries(item)]
    if not isinstance(node, dict):
        return []
    found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
    return found + [q for v in node.values() for q in _queries(v)]


def _queried_names() -> set[str]:
    return {name for query in _queries(_dashboard()) for name in _METRIC.findall(query)}


def test_every_metric_the_dashboard_queries_is_exported():
    exported = exported_names()
    queried = _queried_names()
    assert len(queried) >= 20, sorted(queried)  # the regex really found the queries
    missing = sorted(queried - exported.keys())
    assert not missing, f"the dashboard queries names nobody exports: {missing}"


def test_dashboard_queries_no_name_two_metrics_share():
    """A name two metrics render to would mix them in one query (the pool-size gauge and the
    connector's transferred-blocks counter once shared `disagg_kv_blocks_total`)."""
    exported = exported_names()
    shared = sorted(name for name in _queried_names() if len(exported.get(name, ())) > 1)
    assert not shared, f"ambiguous names queried: {shared}"


def test_no_two_exported_metrics_share_a_name():
    shared = sorted(name for name, owners in exported_names().items() if len(owners) > 1)
    assert not shared, f"names rendered by more than one metric: {shared}"


def test_every_panel_queries_a_disagg_metric_from_the_chosen_data_source():
    panels = [p for p in _dashboard()["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in _dashboard()["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert _METRIC.search(target["expr"]), (panel["title"], target["expr"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


def test_stage_labels_the_dashboard_names_are_real_stages():
    named = {s for q in _queries(_dashboard()) for s in re.findall(r'stage="(\w+)"', q)}
    assert named, "expected the transfer stage to be queried by name"
    assert named <= set(STAGES), named - set(STAGES)
    breakdown_stages = {n.removesuffix("_s") for n in TTFTBreakdown().__dataclass_fields__}
    assert set(STAGES) <= breakdown_stages


@pytest.mark.parametrize("name", METRIC_NAMES)
def test_status_view_reads_exported_names(name: str):
    assert name in exported_names(), f"disagg status reads {name}, which nobody exports"
