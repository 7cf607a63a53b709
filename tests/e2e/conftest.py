"""Fixtures every end-to-end module shares: the aggregated baseline and the reference answers
it gives, both in the module's own `cluster` (tests/conftest.py: its own processes and logs)."""

from __future__ import annotations

import pytest

from tests.e2e.cluster import Cluster, Proc, Reference


@pytest.fixture(scope="module")
def aggregated(cluster: Cluster) -> Proc:
    """The baseline (role both). Started, not awaited: it warms up beside the first instances."""
    return cluster.serve("aggregated")


@pytest.fixture(scope="module")
def reference(aggregated: Proc, cluster: Cluster) -> Reference:
    return Reference(cluster, aggregated)
