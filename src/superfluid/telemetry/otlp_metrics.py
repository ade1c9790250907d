"""The metrics `/metrics` shows, sent over OTLP.

Every `interval_s` a thread reads the Prometheus registry, as a scrape would, and sends its samples as
OTLP points: counters as monotonic cumulative sums (named without `_total`, which a Prometheus exporter
adds back), gauges as gauges, histograms as histograms with the same bucket bounds. A collector so gets
the figures Prometheus would scrape, under the same names and labels; the last ones go as the daemon stops.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from .. import __version__
from .otlp import ExportOutcomes

STOP_WAIT_S = 1.0  # at stop, how long the last export may take before the daemon goes on without it
CUMULATIVE = AggregationTemporality.CUMULATIVE


@dataclass
class _Buckets:
    """One labelled series of a Prometheus histogram, gathered from its samples."""

    labels: dict[str, str]
    cumulative: list[tuple[float, float]] = field(default_factory=list)  # (le, count at or below it)
    count: float = 0.0
    total: float = 0.0

    def point(self, start_ns: int, now_ns: int) -> HistogramDataPoint:
        ordered = sorted(self.cumulative)
        counts = [int(b - a) for a, b in itertools.pairwise([0.0, *(count for _, count in ordered)])]
        return HistogramDataPoint(
            attributes=self.labels,
            start_time_unix_nano=start_ns,
            time_unix_nano=now_ns,
            count=int(self.count),
            sum=self.total,
            bucket_counts=counts,
            explicit_bounds=[le for le, _ in ordered if not math.isinf(le)],
            # a Prometheus histogram knows neither: None leaves them out of the OTLP point
            min=None,  # type: ignore[arg-type]
            max=None,  # type: ignore[arg-type]
        )


def _histogram(family: Any, start_ns: int, now_ns: int) -> Histogram:
    series: dict[tuple[tuple[str, str], ...], _Buckets] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        one = series.setdefault(tuple(sorted(labels.items())), _Buckets(labels))
        if sample.name.endswith("_bucket"):
            one.cumulative.append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_count"):
            one.count = sample.value
        elif sample.name.endswith("_sum"):
            one.total = sample.value
    return Histogram([one.point(start_ns, now_ns) for one in series.values()], CUMULATIVE)


def _metric(family: Any, start_ns: int, now_ns: int) -> Metric | None:
    """One Prometheus family as an OTLP metric; None for a kind no family here has."""

    def points(suffix: str = "") -> list[NumberDataPoint]:
        return [
            NumberDataPoint(dict(sample.labels), start_ns, now_ns, float(sample.value))  # Prometheus values are doubles
            for sample in family.samples
            if sample.name == family.name + suffix
        ]

    data: Sum | Gauge | Histogram
    if family.type == "counter":
        data = Sum(points("_total"), CUMULATIVE, is_monotonic=True)
    elif family.type in ("gauge", "unknown"):
        data = Gauge(points())
    elif family.type == "histogram":
        data = _histogram(family, start_ns, now_ns)
    else:
        return None
    return Metric(family.name, family.documentation, "", data) if data.data_points else None


def metrics_data(registry: CollectorRegistry, resource: Resource, start_ns: int) -> MetricsData:
    """The registry's figures now, as one OTLP export."""
    now_ns = time.time_ns()
    metrics = [m for family in registry.collect() if (m := _metric(family, start_ns, now_ns)) is not None]
    scope = InstrumentationScope("superfluid", __version__)
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")])


class MetricsExport:
    """A thread that sends the registry's figures every `interval_s`, and once more as it stops."""

    def __init__(
        self,
        registry: CollectorRegistry,
        exporter: MetricExporter,
        resource: Resource,
        interval_s: float,
        outcomes: ExportOutcomes,
    ) -> None:
        self.registry = registry
        self.exporter = exporter
        self.resource = resource
        self.interval_s = interval_s
        self.outcomes = outcomes
        self.started_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="superfluid-otlp-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._send()
        self._send()

    def _send(self) -> None:
        try:
            data = metrics_data(self.registry, self.resource, self.started_ns)
            ok, why = self.exporter.export(data) is MetricExportResult.SUCCESS, ""
        except Exception as e:  # an exporter that raises rather than answer FAILURE
            ok, why = False, str(e)
        self.outcomes.record(ok, why)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(STOP_WAIT_S)
        self.exporter.shutdown()
