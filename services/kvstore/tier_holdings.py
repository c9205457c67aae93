"""A kvstore node's host tier as its publisher reads it (services/common/index_publisher.py):
the blocks stored and evicted, by model, so routers find prefixes on the node too."""
from __future__ import annotations

from services.common.index_publisher import HashesByModel, Snapshot
from services.kvstore.host_tier import HostPageTier


def _by_model_key(hashes: dict[bytes, list[int]]) -> HashesByModel:
    return {fingerprint.hex(): h for fingerprint, h in hashes.items()}


class TierHoldings:
    """The tier lives on the node's event loop, as the publisher does: read without a hop.
    A node has no queue: its load figures are the blocks it stores."""

    def __init__(self, tier: HostPageTier) -> None:
        self.tier = tier

    async def start_recording(self) -> None:
        self.tier.enable_events()

    async def snapshot(self, with_held: bool) -> Snapshot:
        added, removed = self.tier.drain_events()
        return Snapshot(queued_tokens=0, free_pages=0, total_pages=self.tier.num_blocks, running=0, waiting=0,
                        added=_by_model_key(added), removed=_by_model_key(removed),
                        held=_by_model_key(self.tier.held()) if with_held else None)

    async def held(self) -> HashesByModel:
        return _by_model_key(self.tier.held())
