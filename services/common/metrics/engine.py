"""`EngineCollector`: an engine's load and pages, read when Prometheus scrapes (collector.py):
nothing is added to the engine's step."""
from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from engine.bucket_counts import BucketCounts
from services.common.metrics.collector import LabelledCollector


class EngineCollector(LabelledCollector):
    """`scheduler` and `block_manager` are the engine's (`engine.scheduler`, `engine.block_manager`);
    `cache_config`, its KV cache's settings by vLLM's label names; `max_loras`, its --max-loras."""

    def __init__(self, scheduler: Any, block_manager: Any, labels: Mapping[str, str],
                 cache_config: Mapping[str, str] | None = None, max_loras: int | None = None) -> None:
        super().__init__(labels)
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.cache_config = dict(cache_config or {})
        self.max_loras = max_loras

    def _info(self, name: str, documentation: str, info: Mapping[str, str], value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=[*self.label_names, *info])
        family.add_metric([*self.label_values, *info.values()], value)
        return family

    def _histogram(self, name: str, documentation: str, counts: BucketCounts) -> HistogramMetricFamily:
        histogram = HistogramMetricFamily(name, documentation, labels=self.label_names)
        histogram.add_metric(self.label_values, [(floatToGoString(bound), count)
                                                 for bound, count in counts.cumulative_buckets()], counts.total)
        return histogram

    def collect(self) -> Iterator[Metric]:
        blocks = self.block_manager
        num_free = blocks.num_free_blocks  # cached pages nobody references count as free: they are evictable
        yield self.gauge("baton_kv_pages_used", "KV pages held by requests and reservations",
                         blocks.num_blocks - num_free)
        yield self.gauge("baton_kv_pages_free", "KV pages free, cached ones included", num_free)
        yield self.gauge("baton_kv_cache_usage_perc", "The fraction of KV pages in use, 0 to 1 (vLLM's)",
                         (blocks.num_blocks - num_free) / blocks.num_blocks)
        yield self.gauge("baton_requests_running", "Requests in the running batch", len(self.scheduler.running))
        yield self.gauge("baton_requests_waiting", "Requests queued for the running batch",
                         len(self.scheduler.waiting))
        yield self._info("baton_cache_config_info", "The KV cache's settings, in its labels (vLLM's cache_config_info)",
                         self.cache_config, 1)
        # A tuple of each queue is taken whole under the GIL: the engine thread cannot change it midway.
        yield self._info("baton_lora_requests_info", "The LoRA adapters of running and waiting requests, in its "
                         "labels; its value, when read (vLLM's lora_requests_info)",
                         {"max_lora": str(self.max_loras or 0),
                          "running_lora_adapters": _adapters(tuple(self.scheduler.running)),
                          "waiting_lora_adapters": _adapters(tuple(self.scheduler.waiting))}, time.time())
        yield self.counter("baton_num_preemptions", "Running requests preempted (their pages freed, to be recomputed)",
                           self.scheduler.num_preemptions)
        yield self._histogram("baton_iteration_tokens", "Tokens each engine step computed (vLLM's "
                              "iteration_tokens_total)", self.scheduler.iteration_tokens)
        residency = blocks.prefix_cache.residency
        if residency is not None:  # vLLM's --kv-cache-metrics, over the sampled blocks evicted so far
            yield self._histogram("baton_kv_block_lifetime_seconds",
                                  "Sampled prefix-cache blocks: from cached to evicted", residency.lifetime)
            yield self._histogram("baton_kv_block_idle_before_evict_seconds",
                                  "Sampled prefix-cache blocks: from their last use to their eviction",
                                  residency.idle_before_evict)
            yield self._histogram("baton_kv_block_reuse_gap_seconds",
                                  "Sampled prefix-cache blocks: between their last few uses, caching the first",
                                  residency.reuse_gap)
        yield self.counter("baton_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                           blocks.num_prefix_query_tokens)
        yield self.counter("baton_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                           blocks.num_prefix_hit_tokens)
        if self.scheduler.drafter is not None:  # vLLM's spec_decode counters, where drafts are made
            yield self.counter("baton_spec_decode_num_draft_tokens", "Speculative draft tokens proposed",
                               self.scheduler.num_draft_tokens)
            yield self.counter("baton_spec_decode_num_accepted_tokens",
                               "Speculative draft tokens accepted (each one a token its step made beyond the first)",
                               self.scheduler.num_accepted_tokens)
            yield self.counter("baton_spec_decode_num_drafts", "Sequences' steps that computed speculative drafts",
                               self.scheduler.num_drafts)
            per_position = CounterMetricFamily(
                "baton_spec_decode_num_accepted_tokens_per_pos",
                "Speculative draft tokens accepted, by their position among a step's drafts (0: the first)",
                labels=[*self.label_names, "position"])
            for position, count in enumerate(list(self.scheduler.num_accepted_tokens_per_position)):
                per_position.add_metric([*self.label_values, str(position)], count)
            yield per_position


def _adapters(seqs: tuple) -> str:
    return ",".join(sorted({seq.sampling_params.lora_name for seq in seqs if seq.sampling_params.lora_name}))
