"""`TierCollector`: a kvstore node's host tier on its /metrics, read when Prometheus scrapes."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric

from services.common.metrics.collector import LabelledCollector
from services.kvstore.host_tier import HostPageTier


class TierCollector(LabelledCollector):
    def __init__(self, tier: HostPageTier, labels: Mapping[str, str]) -> None:
        super().__init__(labels)
        self.tier = tier

    def collect(self) -> Iterator[Metric]:
        tier = self.tier
        yield self.gauge("baton_kv_tier_bytes_used", "Bytes of KV pages the host tier holds", tier.num_bytes)
        yield self.gauge("baton_kv_tier_capacity_bytes", "Bytes the host tier may hold", tier.capacity_bytes)
        yield self.gauge("baton_kv_tier_blocks", "KV blocks the host tier holds", tier.num_blocks)
        yield self.counter("baton_kv_tier_queried_blocks", "Blocks asked for by readers (a prefix each)",
                           tier.num_queried_blocks)
        yield self.counter("baton_kv_tier_hit_blocks", "Blocks asked for and read back", tier.num_hit_blocks)
        if tier.disk is not None:
            disk = tier.disk
            yield self.gauge("baton_kv_disk_tier_bytes_used", "Bytes of KV pages the disk tier holds", disk.num_bytes)
            yield self.gauge("baton_kv_disk_tier_capacity_bytes", "Bytes the disk tier may hold", disk.capacity_bytes)
            yield self.gauge("baton_kv_disk_tier_blocks", "KV blocks the disk tier holds", disk.num_blocks)
            yield self.counter("baton_kv_disk_tier_hit_blocks", "Blocks read back from disk",
                               tier.num_disk_hit_blocks)
