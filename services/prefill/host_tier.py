"""When a prefill worker reads prefix blocks from the host tier, and which it stores there.

Read: the router names a kvstore node that holds more of the prompt's leading blocks
than this worker (prefill.proto, HostTierSource). Before the prompt is queued, the
blocks this worker lacks are read from the node and imported into the local prefix
cache (`BlockManager.import_cached_blocks`), so the engine's allocation takes them as
cached and computes only the rest. Any failure (node gone, timeout, a refused chunk)
is logged and the blocks are computed: the tier is an optimisation, never a dependency.

Store (selective write-through, as SGLang's hierarchical cache does with a hit threshold
of 2): a prefix goes to the tier once it is used again, that is when a request takes
it from this worker's cache; a prompt nobody shares never costs a store. Once the
prompt's pages are handed on, the cached blocks it reused that were not stored within
`remember_s` (nor read from the tier) are streamed to this worker's kvstore node
(`--kvstore`), straight from the held pages, which are released when the stream ends.
Measured on the mesh bench (unique 512-token prompts, one at a time), storing every
computed block instead added ~2 ms to the next request's TTFT on 2 cores. At most
`max_stores_in_flight` streams run at once: a slow node must not pin this worker's
pages, and a request finding every slot busy releases its pages without storing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import grpc
import torch

from engine.block_hash import hash_block_chain, request_extra
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop
from services.kvstore.layout import PageLayout
from services.kvstore.page_copy import copy_pages
from services.prefill.host_tier_client import HostTierClient

log = logging.getLogger("baton.prefill.host_tier")


def import_pages(engine: LLMEngine, prompt: list[int], first_block: int, pages: torch.Tensor,
                 cache_salt: str | None = None) -> int:
    """On the engine thread: `pages` (blocks `first_block ..` of `prompt` salted with `cache_salt`, a pool
    `[L, 2, Hkv, n, bs, D]`) into fresh cached pages; returns the blocks imported."""
    named = engine.block_manager.import_cached_blocks(prompt, first_block, pages.shape[3], cache_salt)
    if named:
        copy_pages(pages, [i - first_block for i, _ in named], engine.runner.kv_pool.tensor, [b for _, b in named])
    return len(named)


class PrefillHostTier:
    """`store_address`: this worker's kvstore node ("" stores nothing); reads go wherever the
    request's HostTierSource says."""

    def __init__(self, pool: torch.Tensor, layout: PageLayout, store_address: str = "", *, checksum: bool = True,
                 max_stores_in_flight: int = 2, remember_s: float = 30.0, remember_max: int = 100_000) -> None:
        self.pool = pool
        self.layout = layout
        self.block_size = layout.block_size
        self.store_address = store_address
        self.client = HostTierClient(layout, checksum=checksum)
        self.max_stores_in_flight = max_stores_in_flight
        self._stores: set[asyncio.Task] = set()
        # Hashes stored on (or read from) the tier lately -> when: not stored again until then.
        # Forgotten after `remember_s` (the node may have evicted them since), least recent first.
        self.remember_s = remember_s
        self.remember_max = remember_max
        self._on_tier: OrderedDict[int, float] = OrderedDict()

    def _remember(self, hashes: list[int]) -> None:
        now = time.monotonic()
        for h in hashes:
            self._on_tier[h] = now
            self._on_tier.move_to_end(h)
        while len(self._on_tier) > self.remember_max:
            self._on_tier.popitem(last=False)

    def _is_on_tier(self, h: int, now: float) -> bool:
        when = self._on_tier.get(h)
        return when is not None and now - when < self.remember_s

    def hashes(self, prompt: list[int], num_blocks: int, cache_salt: str | None = None) -> list[int]:
        return hash_block_chain(prompt[: num_blocks * self.block_size], self.block_size,
                                request_extra(self.layout.fingerprint, None, cache_salt))

    async def fill_prefix(self, engine_loop: EngineLoop, request_id: str, prompt: list[int], address: str,
                          num_blocks: int, cache_salt: str | None = None) -> int:
        """Import the blocks among the prompt's first `num_blocks` (salted with `cache_salt`) that the
        local cache lacks from the node at `address`; returns the prompt tokens imported (0 on any failure)."""
        bs = self.block_size
        # At least one prompt token is always computed: it yields the first token's logits.
        num_blocks = min(num_blocks, (len(prompt) - 1) // bs)
        local = await engine_loop.call(
            lambda engine: engine.block_manager.num_cached_prefix_tokens(prompt, None, cache_salt)) // bs
        if local >= num_blocks:
            return 0
        wanted = self.hashes(prompt, num_blocks, cache_salt)[local:]
        try:
            pages = await self.client.read(address, wanted, request_id)
        except (grpc.aio.AioRpcError, ValueError) as e:
            log.warning("reading %d prefix blocks of %s from the kvstore node %s failed; computing them: %s",
                        num_blocks - local, request_id, address, _describe(e))
            return 0
        if pages.shape[3] == 0:
            return 0
        imported = await engine_loop.call(lambda engine: import_pages(engine, prompt, local, pages, cache_salt))
        self._remember(wanted[: pages.shape[3]])
        return imported * bs

    def store_then(self, request_id: str, prompt: list[int], num_cached_tokens: int, held_block_ids: list[int],
                   release: Callable[[], None], cache_salt: str | None = None) -> bool:
        """Stream the prompt's leading `num_cached_tokens` (reused from the cache; salted with
        `cache_salt`) that the tier is not known to hold to the node, then `release` the held pages.
        False, with nothing started, when there is nothing to store or no free slot: the caller
        releases at once."""
        num_reused = num_cached_tokens // self.block_size
        if not self.store_address or num_reused == 0 or len(self._stores) >= self.max_stores_in_flight:
            return False
        now = time.monotonic()
        hashes = self.hashes(prompt, num_reused, cache_salt)
        missing = [i for i, h in enumerate(hashes) if not self._is_on_tier(h, now)]
        if not missing:
            return False
        # From the first missing block on: a stored block is useless to a reader without its prefix,
        # and the blocks after it were not stored with it either.
        first = missing[0]
        self._remember(hashes[first:])
        task = asyncio.ensure_future(self._store(request_id, held_block_ids[first:num_reused], hashes[first:],
                                                 release))
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
            for h in hashes:  # the next reuse tries again
                self._on_tier.pop(h, None)
            log.warning("storing %d blocks of %s on the kvstore node %s failed: %s", len(blocks), request_id,
                        self.store_address, _describe(e))
        finally:
            release()

    async def reset(self) -> int:
        """A prefix-cache reset: the node forgets what it stores (the blocks it forgot, 0 without a
        node), and this worker what it stored there, so it stores those prefixes again."""
        self._on_tier.clear()
        return await self.client.reset(self.store_address) if self.store_address else 0

    async def close(self) -> None:
        """Let stores in flight finish (they release pages), then close the channels."""
        if self._stores:
            await asyncio.gather(*self._stores, return_exceptions=True)
        await self.client.close()


def _describe(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)


def holds_prefix_of(params: SamplingParams) -> bool:
    """Whether the tier holds (and takes) a request's prefix pages: the base model's, salted or not (a
    salted prefix is stored under hashes its salt is in, which only requests giving that salt ask
    for). Not a LoRA request's: its KV is an adapter's, which may be reloaded under the same name with
    other weights, and the node would not forget it then as a worker does."""
    return params.lora_name is None
