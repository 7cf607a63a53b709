"""Read an instance's or the router's `/metrics` (Prometheus text) into sums the view needs.

Owns parsing only: which metric names mean what is in snapshot.py. Must not fetch anything.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Samples", "parse_samples"]


@dataclass(slots=True)
class Samples:
    """Every sample of one scrape: sample name (with `_total`, `_sum`, ... suffix) -> rows."""

    rows: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def total(self, name: str, **labels: str) -> float | None:
        """Sum of `name`'s samples whose labels include `labels`; None when it has none."""
        matching = [
            value
            for row_labels, value in self.rows.get(name, [])
            if all(row_labels.get(k) == v for k, v in labels.items())
        ]
        return sum(matching) if matching else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """`name`'s samples summed per value of `label` (rows without it are skipped)."""
        sums: dict[str, float] = defaultdict(float)
        for row_labels, value in self.rows.get(name, []):
            if label in row_labels:
                sums[row_labels[label]] += value
        return dict(sums)

    def mean(self, histogram: str, **labels: str) -> float | None:
        """`_sum / _count` of a histogram since the process started; None before any sample."""
        count = self.total(f"{histogram}_count", **labels)
        if not count:
            return None
        return (self.total(f"{histogram}_sum", **labels) or 0.0) / count


def parse_samples(text: str) -> Samples:
    """Parse Prometheus text exposition; raises ValueError when it is not that format."""
    rows: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            rows[sample.name].append((dict(sample.labels), float(sample.value)))
    return Samples(dict(rows))
