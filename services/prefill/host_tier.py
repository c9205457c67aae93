"""When a prefill worker reads prefix blocks from the host tier, and which it stores there.

Read: the router names a kvstore node that holds more of the prompt's leading blocks
than this worker (prefill.proto, HostTierSource). Before the prompt is queued, the
blocks this worker lacks are read from the node and imported into the local prefix
cache (`BlockManager.import_cached_blocks`), so the engine's allocation takes them as
cached and computes only the rest. Any failure (node gone, timeout, a refused chunk)
is logged and the blocks are computed: the tier is an optimisation, never a dependency.

Store (write-through of what was computed, as Mooncake's store does): once a prompt's
pages are handed on, the full blocks this worker computed for it, not those it took
from a cache, are streamed to its kvstore node (`--kvstore`), straight from the held
pages, which are released when the stream ends. So each prefix reaches the tier once
per computation, not once per request. At most `max_stores_in_flight` streams run at
once: a slow node must not pin this worker's pages, and a request finding every slot
busy releases its pages without storing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
import torch

from engine.block_hash import hash_block_chain
from engine.llm_engine import LLMEngine
from services.common.engine_loop import EngineLoop
from services.kvstore.layout import PageLayout
from services.kvstore.page_copy import copy_pages
from services.prefill.host_tier_client import HostTierClient

log = logging.getLogger("baton.prefill.host_tier")


def import_pages(engine: LLMEngine, prompt: list[int], first_block: int, pages: torch.Tensor) -> int:
    """On the engine thread: `pages` (blocks `first_block ..` of `prompt`, a pool
    `[L, 2, Hkv, n, bs, D]`) into fresh cached pages; returns the blocks imported."""
    named = engine.block_manager.import_cached_blocks(prompt, first_block, pages.shape[3])
    if named:
        copy_pages(pages, [i - first_block for i, _ in named], engine.runner.kv_pool.tensor, [b for _, b in named])
    return len(named)


class PrefillHostTier:
    """`store_address`: this worker's kvstore node ("" stores nothing); reads go wherever the
    request's HostTierSource says."""

    def __init__(self, pool: torch.Tensor, layout: PageLayout, store_address: str = "", *, checksum: bool = True,
                 max_stores_in_flight: int = 2) -> None:
        self.pool = pool
        self.layout = layout
        self.block_size = layout.block_size
        self.store_address = store_address
        self.client = HostTierClient(layout, checksum=checksum)
        self.max_stores_in_flight = max_stores_in_flight
        self._stores: set[asyncio.Task] = set()

    def hashes(self, prompt: list[int], num_blocks: int) -> list[int]:
        return hash_block_chain(prompt[: num_blocks * self.block_size], self.block_size, self.layout.fingerprint)

    async def fill_prefix(self, engine_loop: EngineLoop, request_id: str, prompt: list[int], address: str,
                          num_blocks: int) -> int:
        """Import the blocks among the prompt's first `num_blocks` that the local cache lacks from
        the node at `address`; returns the prompt tokens imported (0 on any failure)."""
        bs = self.block_size
        # At least one prompt token is always computed: it yields the first token's logits.
        num_blocks = min(num_blocks, (len(prompt) - 1) // bs)
        local = await engine_loop.call(lambda engine: engine.block_manager.num_cached_prefix_tokens(prompt)) // bs
        if local >= num_blocks:
            return 0
        try:
            pages = await self.client.read(address, self.hashes(prompt, num_blocks)[local:], request_id)
        except (grpc.aio.AioRpcError, ValueError) as e:
            log.warning("reading %d prefix blocks of %s from the kvstore node %s failed; computing them: %s",
                        num_blocks - local, request_id, address, _describe(e))
            return 0
        if pages.shape[3] == 0:
            return 0
        imported = await engine_loop.call(lambda engine: import_pages(engine, prompt, local, pages))
        return imported * bs

    def store_then(self, request_id: str, prompt: list[int], num_cached_tokens: int, held_block_ids: list[int],
                   release: Callable[[], None]) -> bool:
        """Stream the full prompt blocks computed for this request (from `num_cached_tokens` on) to
        the node, then `release` the held pages. False, with nothing started, when there is nothing
        to store or no free slot: the caller releases at once."""
        bs = self.block_size
        first, end = num_cached_tokens // bs, len(prompt) // bs
        if not self.store_address or first >= end or len(self._stores) >= self.max_stores_in_flight:
            return False
        hashes = self.hashes(prompt, end)[first:]
        task = asyncio.ensure_future(self._store(request_id, held_block_ids[first:end], hashes, release))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)
        return True

    async def _store(self, request_id: str, blocks: list[int], hashes: list[int], release: Callable[[], None]
                     ) -> None:
        start = time.perf_counter()
        try:
            num_bytes = await self.client.write(self.store_address, self.pool, blocks, hashes, request_id)
            log.debug("stored %d blocks (%d bytes) of %s in %.1f ms", len(blocks), num_bytes, request_id,
                      (time.perf_counter() - start) * 1e3)
        except (grpc.aio.AioRpcError, ValueError) as e:
            log.warning("storing %d blocks of %s on the kvstore node %s failed: %s", len(blocks), request_id,
                        self.store_address, _describe(e))
        finally:
            release()

    async def close(self) -> None:
        """Let stores in flight finish (they release pages), then close the channels."""
        if self._stores:
            await asyncio.gather(*self._stores, return_exceptions=True)
        await self.client.close()


def _describe(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)
