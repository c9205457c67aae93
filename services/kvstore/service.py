"""A kvstore node's service, as services/common/entrypoint.py runs it (`python -m services.kvstore`:
__main__.py): the host page tier and its prefix-cache controls, its place in the registry and the blocks
it holds in the prefix index."""
from __future__ import annotations

import asyncio

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)
from protos import cache_pb2_grpc, kvstore_pb2_grpc
from services.common.cache_servicer import SERVICE_NAME as CACHE_SERVICE_NAME
from services.common.index_publisher import InstancePublisher, holdings_publisher
from services.common.metrics import ServiceMetrics
from services.kvstore.config import KVStoreNodeConfig
from services.kvstore.disk_tier import DiskPageTier
from services.kvstore.servicer import SERVICE_NAME, HostTierCacheServicer, KVStoreNodeServicer
from services.kvstore.tier_holdings import TierHoldings
from services.kvstore.tier_metrics import TierCollector


class KVStoreNode:
    service_names = [SERVICE_NAME, CACHE_SERVICE_NAME]

    def __init__(self, config: KVStoreNodeConfig):
        self.config = config
        disk = DiskPageTier(config.disk_dir, config.disk_capacity_bytes) if config.disk_dir else None
        self.servicer = KVStoreNodeServicer(config.capacity_bytes, disk)
        self.servicers = [(kvstore_pb2_grpc.add_KVStoreServicer_to_server, self.servicer),
                          (cache_pb2_grpc.add_PrefixCacheServicer_to_server, HostTierCacheServicer(self.servicer.tier))]
        self.port = 0  # the bound one, set by the entry point before `start`
        self.publisher: InstancePublisher | None = None
        self.metrics = ServiceMetrics("kvstore")  # the entry point's, labelled and served, replaces it

    async def start(self, stop: asyncio.Event) -> str | None:
        self.metrics.registry.register(TierCollector(self.servicer.tier, self.metrics.labels))
        # A node serves any model: its registry entry names none, its index entries each name theirs.
        self.publisher = holdings_publisher("kvstore", self.config, self.port, TierHoldings(self.servicer.tier),
                                            model_key="", block_size=0, publish_blocks=True)
        if self.publisher is not None:
            await self.publisher.start(stop)
        disk = f", over a disk tier of {self.config.disk_capacity_bytes} bytes in {self.config.disk_dir}" \
            if self.config.disk_dir else ""
        return f"serving a host page tier of {self.config.capacity_bytes} bytes{disk}"

    async def close(self) -> None:
        """Leave Redis; the pages live in this process's memory: they go with it, and those on its disk
        tier are deleted (no index would know them again)."""
        if self.publisher is not None:
            await self.publisher.close()
        if self.servicer.tier.disk is not None:
            await asyncio.to_thread(self.servicer.tier.disk.close)

