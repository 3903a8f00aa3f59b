"""Many replicas' Prometheus expositions as one, each series labelled with its replica.

Pure functions over the text format (0.0.4) that ``ServerMetrics.render`` writes: no Ray, so
that the tests read them directly. A family that several replicas export is written once,
with every replica's samples under it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class _Families:
    """A collector over already-built families, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(by_replica: Mapping[str, bytes]) -> bytes:
    """One exposition of every replica's (``replica id -> exposition``), in replica order,
    each sample carrying ``replica="<id>"``."""
    merged: dict[str, Metric] = {}
    for replica in sorted(by_replica):
        text = by_replica[replica].decode()
        for family in text_string_to_metric_families(text):
            kept = merged.get(family.name)
            if kept is None:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = kept
            kept.samples += [_labelled(sample, replica) for sample in family.samples]
    return generate_latest(_Families(list(merged.values())))


def _labelled(sample: Sample, replica: str) -> Sample:
    return sample._replace(labels={REPLICA_LABEL: replica, **sample.labels})
