"""`EngineCollector`: an engine's load and pages, read when Prometheus scrapes.

Nothing is added to the engine's step: each scrape reads a few plain ints and
container lengths of the scheduler and the block manager from the scraping thread.
In CPython each such read is atomic under the GIL; the figures of one scrape may be
a step apart, which a gauge sampled every few seconds does not notice.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class EngineCollector(Collector):
    """`scheduler` and `block_manager` are the engine's (`engine.scheduler`, `engine.block_manager`)."""

    def __init__(self, scheduler: Any, block_manager: Any, labels: Mapping[str, str]) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.label_names = list(labels)
        self.label_values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        blocks = self.block_manager
        num_free = blocks.num_free_blocks  # cached pages nobody references count as free: they are evictable
        yield self._gauge("baton_kv_pages_used", "KV pages held by requests and reservations",
                          blocks.num_blocks - num_free)
        yield self._gauge("baton_kv_pages_free", "KV pages free, cached ones included", num_free)
        yield self._gauge("baton_requests_running", "Requests in the running batch", len(self.scheduler.running))
        yield self._gauge("baton_requests_waiting", "Requests queued for the running batch",
                          len(self.scheduler.waiting))
        yield self._counter("baton_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                            blocks.num_prefix_query_tokens)
        yield self._counter("baton_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                            blocks.num_prefix_hit_tokens)

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=self.label_names)
        family.add_metric(self.label_values, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=self.label_names)
        family.add_metric(self.label_values, value)
        return family
