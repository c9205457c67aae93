"""`BlockManager`: which sequences hold which KV pages, and how many hold each. The pages come from
its pool (engine/block_pool.py); its prefix cache (engine/prefix_cache.py) names the pages that
hold cached blocks, its reservations (engine/reservations.py) the pages set aside for remote prefill.
The pages it shares are full blocks of computed tokens, which no sequence writes again: a prompt's cached
prefix stops short of its last token, computed for the next token's logits."""
from __future__ import annotations

from collections.abc import Sequence as TokenIds
from typing import TYPE_CHECKING

from engine.block import Block
from engine.block_integrity import check_block_integrity
from engine.block_pool import BlockPool
from engine.free_queue import MAX_CHANCES
from engine.kv_block_residency import KVBlockResidency
from engine.kv_event_log import KVEvent
from engine.prefix_cache import PrefixCache
from engine.reservations import Reservations
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.state_snapshots import StateSnapshots


class BlockManager:
    """Hands out pages to sequences and shares identical full blocks between them.

    Contract: a sequence gets pages from `allocate` (or `adopt`), grows them with
    `append_slot` and gives them back with `free`; callers ask the paired
    `can_*` first, and an act that cannot be satisfied raises RuntimeError
    before changing anything. Every block is either referenced (ref_count > 0)
    or in the free queue, whose head is evicted first (least recently freed),
    with more chances (GCLOCK) for a cached block that served prefix hits.
    Never touches a tensor.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_extra: bytes = b"",
        enable_prefix_caching: bool = True,
        residency_sample_rate: float = 0.0,
        num_state_blocks: int = 0,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        """`residency_sample_rate`: the fraction of cached blocks whose residency is measured
        (engine/kv_block_residency.py); 0: none. `num_state_blocks`: the pages each sequence holds beside its
        tokens' for a hybrid model's recurrent states (engine/recurrent_state.py), none of them shared; `snapshots`:
        the states kept at the ends of cached prefixes (engine/state_snapshots.py), where a cached prefix is
        continued from only if they are kept at its end."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_state_blocks = num_state_blocks
        self.snapshots = snapshots
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.prefix_cache = PrefixCache(self.blocks, block_size, hash_extra, enable_prefix_caching)
        if residency_sample_rate:
            self.prefix_cache.residency = KVBlockResidency(residency_sample_rate)
        self.pool = BlockPool(self.blocks, self.prefix_cache)
        self.free_block_ids = self.pool.free_block_ids  # the pool's, held here too for allocate and free
        # Sequences holding blocks, and the chain hashes of their leading full
        # blocks that were already matched or registered (to continue the chain).
        self._seqs: dict[str, Sequence] = {}
        self._seq_hashes: dict[str, list[int]] = {}
        self.reservations = Reservations(self.pool, block_size)
        # Prefix-cache stats in tokens, as vLLM counts them.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached ones included: they are evictable."""
        return len(self.free_block_ids)

    @property
    def hash_to_block_id(self) -> dict[int, int]:
        """The prefix cache's map from a cached block's chain hash to the page holding it."""
        return self.prefix_cache.hash_to_block_id

    # ---- prefix cache ---------------------------------------------------------

    def _max_cached_blocks(self, num_tokens: int) -> int:
        # At least one token must be computed to produce the next token's logits.
        return max(0, (num_tokens - 1) // self.block_size)

    def _max_blocks_read(self, seq: Sequence) -> int:
        """A sequence that reads every prompt row (its logprobs, or each token's embedding) reads no prefix."""
        return 0 if seq.reads_every_prompt_row else self._max_cached_blocks(seq.num_tokens)

    def _match(self, token_ids: TokenIds[int], max_blocks: int, lora_name: str | None,
               cache_salt: str | None) -> tuple[list[int], list[int]]:
        """The prefix cache's match: the cached pages of the leading blocks, and every full block's chain hash; for a
        hybrid model, cut back to the longest prefix whose recurrent states were kept at its end."""
        block_ids, hashes = self.prefix_cache.match(token_ids, max_blocks, lora_name, cache_salt)
        if self.snapshots is not None:
            num_kept = next((n for n in range(len(block_ids), 0, -1) if hashes[n - 1] in self.snapshots), 0)
            block_ids, hashes = block_ids[:num_kept], hashes[:num_kept]
        return block_ids, hashes

    def num_cached_prefix_tokens(self, token_ids: TokenIds[int], lora_name: str | None = None,
                                 cache_salt: str | None = None) -> int:
        """Leading tokens of `token_ids` that `allocate` would take from the cache now."""
        block_ids, _ = self._match(token_ids, self._max_cached_blocks(len(token_ids)), lora_name, cache_salt)
        return len(block_ids) * self.block_size

    def block_hash(self, seq: Sequence, index: int) -> int | None:
        """The chain hash of `seq`'s block `index`, once it is a full, computed block the cache knows."""
        hashes = self._seq_hashes.get(seq.request_id, ())
        return hashes[index] if index < len(hashes) else None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every full, computed block of `seq` that is not registered yet.

        Called once the KV of the first `seq.num_computed_tokens` tokens is in
        the pages. If identical content is already registered to another block,
        the map keeps pointing there and this page stays an unnamed copy.
        """
        hashes = self._seq_hashes.get(seq.request_id)
        if hashes is not None:
            self.prefix_cache.cache_full_blocks(seq, hashes)

    def forget_adapter(self, lora_name: str) -> None:
        """Forget every cached block computed with LoRA adapter `lora_name`, now unloaded: another
        adapter loaded later under its name would hash the same prompts to them."""
        self.prefix_cache.forget_adapter(lora_name)

    def reset_prefix_cache(self) -> int | None:
        """Forget every cached block (vLLM's reset_prefix_cache) when no page is held: the number
        forgotten. None with pages held, as vLLM and SGLang refuse: a flush is for a cold start of
        what comes next, which requests still running would not see."""
        if self.num_free_blocks < self.num_blocks:
            return None
        if self.snapshots is not None:  # the states at cached prefixes' ends go with them
            self.snapshots.clear()
        return self.prefix_cache.reset()

    # ---- cache events: what a prefix index outside this process must learn -----------

    def enable_cache_events(self) -> None:
        """Start recording hashes that enter and leave the prefix cache (for `drain_cache_events`)."""
        self.prefix_cache.enable_events()

    def drain_cache_events(self) -> tuple[list[int], list[int]]:
        """(hashes added, hashes removed) since the last drain, as net changes: a hash added
        and evicted in between is in neither list. Empty until `enable_cache_events`."""
        return self.prefix_cache.drain_events()

    def enable_kv_events(self) -> list[KVEvent]:
        """Start recording every change of the prefix cache, in order (vLLM's KV events, taken by
        `take_kv_events`); the events that tell a subscriber starting now what is cached."""
        return self.prefix_cache.enable_kv_events()

    def take_kv_events(self) -> list[KVEvent]:
        """The changes since the last take, in order; none until `enable_kv_events`."""
        kv_events = self.prefix_cache.kv_events
        return kv_events.take() if kv_events else []

    def cached_hashes(self) -> list[int]:
        """Every hash the prefix cache holds now, in use or evictable (for a full republish)."""
        return list(self.prefix_cache.hash_to_block_id)

    # ---- allocation -----------------------------------------------------------

    def _num_revived(self, block_ids: list[int]) -> int:
        """Matched blocks that sit in the free queue: they need no fresh block but leave the pool."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def can_allocate(self, seq: Sequence) -> bool:
        matched, _ = self._match(seq.token_ids, self._max_blocks_read(seq), seq.sampling_params.lora_name,
                                 seq.sampling_params.cache_salt)
        num_wanted = seq.num_blocks - len(matched) + self.num_state_blocks
        return num_wanted <= self.num_free_blocks - self._num_revived(matched)

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence without pages (new or preempted) its cached prefix plus fresh blocks.

        Sets `block_table`, and `num_cached_tokens = num_computed_tokens` to the matched tokens.
        """
        if seq.block_table or seq.request_id in self._seqs:
            raise ValueError(f"{seq.request_id!r} already holds blocks")
        matched, hashes = self._match(seq.token_ids, self._max_blocks_read(seq), seq.sampling_params.lora_name,
                                      seq.sampling_params.cache_salt)
        num_fresh = seq.num_blocks - len(matched)
        if num_fresh + self.num_state_blocks > self.num_free_blocks - self._num_revived(matched):
            raise RuntimeError(f"not enough free KV blocks for {seq.request_id!r}")
        # Claim the matched blocks before taking fresh ones, so no fresh
        # allocation can evict a block this sequence is about to share.
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_block_ids.remove(block_id)
            block.ref_count += 1
            block.chances = min(MAX_CHANCES, block.chances + 1)
        self.prefix_cache.used(matched)
        seq.block_table = matched + self.pool.take_free_blocks(num_fresh)
        seq.state_blocks = self.pool.take_free_blocks(self.num_state_blocks) if self.num_state_blocks else []
        if self.snapshots is not None and matched:  # its states start where the cached prefix ends
            seq.restored_state = self.snapshots.get(hashes[len(matched) - 1])
        seq.num_cached_tokens = seq.num_computed_tokens = len(matched) * self.block_size
        self._seqs[seq.request_id] = seq
        self._seq_hashes[seq.request_id] = hashes
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens

    def _num_append_blocks(self, seq: Sequence) -> int:
        return max(0, seq.num_blocks - len(seq.block_table))

    def can_append_slot(self, seq: Sequence) -> bool:
        return self._num_append_blocks(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Give every uncomputed token of `seq` a slot."""
        if seq.request_id not in self._seqs:
            raise ValueError(f"{seq.request_id!r} holds no blocks: allocate it first")
        num_missing = self._num_append_blocks(seq)
        if num_missing > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks to append to {seq.request_id!r}")
        # Usually one block, the LRU head; several (a long chunk) come as runs.
        seq.block_table.extend(self.pool.take_free_blocks(num_missing))

    def free(self, seq: Sequence) -> None:
        """Release a sequence's pages; a no-op for one that holds none."""
        held = self._seqs.pop(seq.request_id, None)
        if held is None:
            return
        del self._seq_hashes[seq.request_id]
        # Reverse order: a prefix's tail is evicted before its head, which more
        # requests share.
        for block_id in (*reversed(held.block_table), *held.state_blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.push(block_id)
        held.block_table, held.state_blocks = [], []

    # ---- reservations -----------------------------------------------------------

    def can_reserve(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def reserve(self, reservation_id: str, num_blocks: int) -> list[int]:
        """Set `num_blocks` fresh pages aside under `reservation_id`; returns their ids."""
        if reservation_id in self._seqs:
            raise ValueError(f"{reservation_id!r} already holds blocks")
        return self.reservations.reserve(reservation_id, num_blocks)

    def release(self, reservation_id: str) -> bool:
        """Give back reserved pages nobody adopted (lease expiry, abort). False if unknown."""
        return self.reservations.release(reservation_id)

    def rename_reservation(self, reservation_id: str, new_id: str) -> bool:
        """Hold reserved pages under `new_id`, so that `reservation_id` may reserve again. False if unknown."""
        return self.reservations.rename(reservation_id, new_id)

    def adopt(self, reservation_id: str, seq: Sequence) -> None:
        """Make the reserved pages `seq`'s leading blocks, their KV already written for
        its first `seq.num_computed_tokens` tokens (and its states, in the last `num_state_blocks`).
        Full blocks join the prefix cache."""
        if seq.block_table or seq.request_id in self._seqs:
            raise ValueError(f"{seq.request_id!r} already holds blocks")
        block_ids = self.reservations.hand_over(reservation_id, seq.num_computed_tokens, self.num_state_blocks)
        num_token_blocks = len(block_ids) - self.num_state_blocks
        seq.block_table, seq.state_blocks = block_ids[:num_token_blocks], block_ids[num_token_blocks:]
        self._seqs[seq.request_id] = seq
        self._seq_hashes[seq.request_id] = []
        self.cache_computed_blocks(seq)

    # ---- blocks computed elsewhere ------------------------------------------------

    def import_cached_blocks(self, token_ids: TokenIds[int], first_block: int, num_blocks: int,
                             cache_salt: str | None = None) -> list[tuple[int, int]]:
        """Name fresh pages as the cached blocks `first_block .. first_block + num_blocks - 1` of
        `token_ids` (the base model's, salted with `cache_salt` if given), whose KV another instance
        computed (read back from the host tier), so that the next `allocate` of a prompt with this
        prefix takes them instead of computing.

        Returns (block index, page id) for each block named, in order: the caller writes that
        block's KV into the page before anything else touches this manager (the same engine
        command), since the page is free and evictable like any cached block. Fewer are named
        when pages run short (no page of the cached prefix before `first_block` is evicted for
        them), none when that prefix is not all cached here (they would be unreachable), and a
        block already cached is skipped.
        """
        return self.pool.import_cached_blocks(token_ids, first_block, num_blocks, cache_salt)

    # ---- checking -------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first inconsistency between pages, tables and map."""
        check_block_integrity(self.blocks, self.free_block_ids, self._seqs, self._seq_hashes,
                              self.reservations.block_ids, self.num_state_blocks)
        self.prefix_cache.check_integrity()
