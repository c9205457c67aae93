"""`LabelledCollector`: a collector that reads its figures when Prometheus scrapes, each as a
gauge or counter family carrying the service's labels.

Subclasses read plain ints and container lengths of objects another thread owns (an
engine, a page tier): in CPython each such read is atomic under the GIL; the figures of
one scrape may be a step apart, which a gauge sampled every few seconds does not notice.
"""
from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class LabelledCollector(Collector):
    def __init__(self, labels: Mapping[str, str]) -> None:
        self.label_names = list(labels)
        self.label_values = list(labels.values())

    def gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=self.label_names)
        family.add_metric(self.label_values, value)
        return family

    def counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        """`name` without `_total`: the exposition adds it."""
        family = CounterMetricFamily(name, documentation, labels=self.label_names)
        family.add_metric(self.label_values, value)
        return family
