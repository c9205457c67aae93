"""`PrefixCache`: which pages hold the KV of which full blocks (nano-vllm's hash -> block map, the
hash chained over the blocks before), and what a prefix index outside the process must learn of it."""
from __future__ import annotations

from collections.abc import Sequence as TokenIds

from engine.block import Block
from engine.block_hash import block_hash, hash_block_chain, request_extra
from engine.cache_events import CacheEvents
from engine.kv_block_residency import KVBlockResidency
from engine.kv_event_log import KVEvent, KVEventLog, stored_now
from engine.sequence import Sequence


class PrefixCache:
    """The cached blocks among `blocks`, each found by the chain hash of its tokens.

    Contract: a block is cached exactly while `hash_to_block_id` maps its `hash` to it, and
    `cache` and `uncache` change both together (recording the change once `enable_events` is
    called). The cache never takes or frees a page: a freed page stays cached, and whoever
    reuses it uncaches it first (lazy eviction). Disabled, it matches and caches nothing.
    """

    def __init__(self, blocks: list[Block], block_size: int, hash_extra: bytes, is_enabled: bool) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.hash_extra = hash_extra
        self.is_enabled = is_enabled
        self.hash_to_block_id: dict[int, int] = {}
        self.events: CacheEvents | None = None  # recorded once `enable_events` is called
        self.kv_events: KVEventLog | None = None  # recorded once `enable_kv_events` is called
        self.residency: KVBlockResidency | None = None  # sampled blocks' lifetimes (vLLM's --kv-cache-metrics)

    def extra(self, lora_name: str | None, cache_salt: str | None = None) -> bytes:
        """The hash extra of KV computed with `lora_name`'s adapter (None: the base model) for requests
        salted with `cache_salt` (None: unsalted)."""
        return request_extra(self.hash_extra, lora_name, cache_salt)

    def match(self, token_ids: TokenIds[int], max_blocks: int, lora_name: str | None = None,
              cache_salt: str | None = None) -> tuple[list[int], list[int]]:
        """Block ids and chain hashes of the longest cached prefix (at most `max_blocks`) computed
        with `lora_name`'s adapter (None: the base model) under `cache_salt` (None: unsalted)."""
        block_ids: list[int] = []
        hashes: list[int] = []
        if not self.is_enabled:
            return block_ids, hashes
        bs, extra = self.block_size, self.extra(lora_name, cache_salt)
        parent: int | None = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens, extra)
            block_id = self.hash_to_block_id.get(parent)
            # Equal hashes may still collide: a hit must hold the same tokens.
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return block_ids, hashes

    def cache_full_blocks(self, seq: Sequence, hashes: list[int]) -> None:
        """Cache the full, computed blocks of `seq` after its first `len(hashes)`, whose chain
        hashes `hashes` holds; the new ones are appended to it."""
        if not self.is_enabled:
            return
        bs, lora_name = self.block_size, seq.sampling_params.lora_name
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        first = len(hashes)
        extra = self.extra(lora_name, seq.sampling_params.cache_salt)
        new_hashes = hash_block_chain(seq.token_ids[first * bs : num_full * bs], bs, extra,
                                      hashes[-1] if hashes else None)
        for i, h in enumerate(new_hashes, start=first):
            parent = hashes[-1] if hashes else None
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            # Content already cached in another page stays there; this page is an unnamed copy.
            if block.hash is None and h not in self.hash_to_block_id:
                self.cache(block, h, tuple(seq.block_tokens(i)), lora_name, parent)

    def uncached_blocks(self, token_ids: TokenIds[int], first_block: int, stop_block: int, parent: int | None,
                        cache_salt: str | None = None) -> list[tuple[int, int, tuple[int, ...], int | None]]:
        """(block index, chain hash, tokens, parent's chain hash) of each of the base model's blocks
        `first_block .. stop_block - 1` of `token_ids` (salted with `cache_salt`, if given) that is not
        cached, `parent` the chain hash before them."""
        bs, extra = self.block_size, self.extra(None, cache_salt)
        uncached: list[tuple[int, int, tuple[int, ...], int | None]] = []
        for i in range(first_block, stop_block):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens, extra)
            if h not in self.hash_to_block_id:
                uncached.append((i, h, tokens, parent))
            parent = h
        return uncached

    def cache(self, block: Block, h: int, tokens: tuple[int, ...], lora_name: str | None, parent: int | None) -> None:
        """Make `block` the holder of hash `h`, whose KV for `tokens` it holds (computed with
        `lora_name`'s adapter, after the block hashed `parent`); `h` must not be cached yet."""
        block.hash, block.token_ids, block.lora_name, block.parent_hash = h, tokens, lora_name, parent
        self.hash_to_block_id[h] = block.block_id
        self._record(h, True)
        if self.kv_events is not None:
            self.kv_events.stored(h, parent, tokens, lora_name)
        if self.residency is not None:
            self.residency.cached(block.block_id)

    def used(self, block_ids: list[int]) -> None:
        """Cached blocks a prompt reads instead of computing."""
        if self.residency is not None:
            for block_id in block_ids:
                self.residency.used(block_id)

    def evict(self, block: Block) -> None:
        """Uncache `block` to reuse its page for other content."""
        if self.residency is not None:
            self.residency.evicted(block.block_id)
        self.uncache(block)

    def uncache(self, block: Block) -> None:
        """Forget the content of cached `block`: its page is about to be reused, or its KV is stale."""
        del self.hash_to_block_id[block.hash]
        self._record(block.hash, False)
        if self.kv_events is not None:
            self.kv_events.removed(block.hash)
        if self.residency is not None:
            self.residency.forgotten(block.block_id)
        block.hash, block.token_ids, block.lora_name, block.parent_hash = None, (), None, None

    def forget_adapter(self, lora_name: str) -> None:
        """Uncache every block computed with LoRA adapter `lora_name`."""
        for block in self.blocks:
            if block.hash is not None and block.lora_name == lora_name:
                self.uncache(block)

    def reset(self) -> int:
        """Uncache every block: the number uncached."""
        cached = [block for block in self.blocks if block.hash is not None]
        for block in cached:
            self.uncache(block)
        if self.kv_events is not None:
            self.kv_events.cleared()
        return len(cached)

    # ---- cache events: what a prefix index outside this process must learn -----------

    def enable_events(self) -> None:
        """Start recording hashes that enter and leave the cache (for `drain_events`)."""
        if self.events is None:
            self.events = CacheEvents()

    def enable_kv_events(self) -> list[KVEvent]:
        """Start recording every change in order (`kv_events`); the events that tell a subscriber
        starting now what is cached."""
        self.kv_events = KVEventLog()
        return stored_now(self.blocks)

    def _record(self, h: int, is_added: bool) -> None:
        if self.events is not None:
            self.events.record(h, is_added)

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(hashes added, hashes removed) since the last drain, as net changes: a hash added
        and evicted in between is in neither list. Empty until `enable_events`."""
        return self.events.drain() if self.events is not None else ([], [])

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first disagreement between the map and the blocks' hashes."""
        for block in self.blocks:
            if block.hash is not None:
                b = block.block_id
                assert self.hash_to_block_id.get(block.hash) == b, f"block {b}: its hash maps elsewhere"
        for h, b in self.hash_to_block_id.items():
            assert self.blocks[b].hash == h, f"hash {h:#x} maps to block {b}, which has {self.blocks[b].hash}"
