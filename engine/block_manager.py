"""`BlockManager`: owns the KV pages, their reference counts and the prefix-cache map."""
from __future__ import annotations

from collections.abc import Sequence as TokenIds
from dataclasses import dataclass

from engine.block_hash import block_hash, hash_block_chain, with_adapter
from engine.cache_events import CacheEvents
from engine.free_queue import MAX_CHANCES, FreeQueue, fewest_runs
from engine.sequence import Sequence

# (src_block, dst_block) page copies the runner must do before the next forward.
CopyPairs = list[tuple[int, int]]


@dataclass(slots=True, eq=False)
class Block:
    """One page of KV.

    `hash` is set only while this block is the registered holder of a full,
    computed block whose tokens are `token_ids`; it survives the block being
    freed and is dropped when the page is reused (lazy eviction). `chances` is
    how many more times eviction passes the block over: each prefix hit adds one
    (up to MAX_CHANCES), each pass takes one.
    """

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    chances: int = 0
    lora_name: str | None = None  # the adapter its cached KV was computed with (None: the base model)


class BlockManager:
    """Hands out pages to sequences and shares identical full blocks between them.

    Contract: a sequence gets pages from `allocate` (or `fork`), grows them with
    `append_slot` and gives them back with `free`; callers ask the paired
    `can_*` first, and an act that cannot be satisfied raises RuntimeError
    before changing anything. Every block is either referenced (ref_count > 0)
    or in the free queue, whose head is evicted first (least recently freed),
    with more chances (GCLOCK) for a cached block that served prefix hits.
    Pages that are shared are never written: `append_slot` and `fork` return
    the copies that keep it so. Never touches a tensor.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_extra: bytes = b"",
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.hash_extra = hash_extra
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = FreeQueue(self.blocks)
        self.hash_to_block_id: dict[int, int] = {}
        # Sequences holding blocks, and the chain hashes of their leading full
        # blocks that were already matched or registered (to continue the chain).
        self._seqs: dict[str, Sequence] = {}
        self._seq_hashes: dict[str, list[int]] = {}
        # Pages set aside for a request whose KV another worker writes (disaggregated
        # prefill): held by id until a sequence adopts them or they are released.
        self._reservations: dict[str, list[int]] = {}
        # Prefix-cache stats in tokens, as vLLM counts them.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._cache_events: CacheEvents | None = None  # recorded once `enable_cache_events` is called

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached ones included: they are evictable."""
        return len(self.free_block_ids)

    # ---- prefix cache ---------------------------------------------------------

    def _extra(self, lora_name: str | None) -> bytes:
        return with_adapter(self.hash_extra, lora_name)

    def _match(self, token_ids: TokenIds[int], max_blocks: int,
               lora_name: str | None = None) -> tuple[list[int], list[int]]:
        """Block ids and chain hashes of the longest cached prefix (at most `max_blocks`) computed
        with `lora_name`'s adapter (None: the base model)."""
        block_ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return block_ids, hashes
        bs, extra = self.block_size, self._extra(lora_name)
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

    def _max_cached_blocks(self, num_tokens: int) -> int:
        # At least one token must be computed to produce the next token's logits.
        return max(0, (num_tokens - 1) // self.block_size)

    def _max_blocks_read(self, seq: Sequence) -> int:
        """A sequence that wants its prompt's logprobs computes every token: it reads no prefix."""
        return 0 if seq.prompt_logprobs is not None else self._max_cached_blocks(seq.num_tokens)

    def num_cached_prefix_tokens(self, token_ids: TokenIds[int], lora_name: str | None = None) -> int:
        """Leading tokens of `token_ids` that `allocate` would take from the cache now."""
        block_ids, _ = self._match(token_ids, self._max_cached_blocks(len(token_ids)), lora_name)
        return len(block_ids) * self.block_size

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every full, computed block of `seq` that is not registered yet.

        Called once the KV of the first `seq.num_computed_tokens` tokens is in
        the pages. If identical content is already registered to another block,
        the map keeps pointing there and this page stays an unnamed copy.
        """
        hashes = self._seq_hashes.get(seq.request_id)
        if not self.enable_prefix_caching or hashes is None:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        first = len(hashes)
        new_hashes = hash_block_chain(seq.token_ids[first * bs : num_full * bs], bs,
                                      self._extra(seq.sampling_params.lora_name),
                                      hashes[-1] if hashes else None)
        for i, parent in enumerate(new_hashes, start=first):
            tokens = tuple(seq.block_tokens(i))
            hashes.append(parent)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and parent not in self.hash_to_block_id:
                block.hash = parent
                block.token_ids = tokens
                block.lora_name = seq.sampling_params.lora_name
                self.hash_to_block_id[parent] = block.block_id
                self._record(parent, True)

    def _uncache(self, block: Block) -> None:
        del self.hash_to_block_id[block.hash]
        self._record(block.hash, False)
        block.hash, block.token_ids, block.lora_name = None, (), None

    def forget_adapter(self, lora_name: str) -> None:
        """Forget every cached block computed with LoRA adapter `lora_name`, now unloaded: another
        adapter loaded later under its name would hash the same prompts to them."""
        for block in self.blocks:
            if block.hash is not None and block.lora_name == lora_name:
                self._uncache(block)

    def reset_prefix_cache(self) -> int | None:
        """Forget every cached block (vLLM's reset_prefix_cache) when no page is held: the number
        forgotten. None with pages held, as vLLM and SGLang refuse: a flush is for a cold start of
        what comes next, which requests still running would not see."""
        if self.num_free_blocks < self.num_blocks:
            return None
        cached = [block for block in self.blocks if block.hash is not None]
        for block in cached:
            self._uncache(block)
        return len(cached)

    # ---- cache events: what a prefix index outside this process must learn -----------

    def enable_cache_events(self) -> None:
        """Start recording hashes that enter and leave the prefix cache (for `drain_cache_events`)."""
        if self._cache_events is None:
            self._cache_events = CacheEvents()

    def _record(self, h: int, is_added: bool) -> None:
        if self._cache_events is not None:
            self._cache_events.record(h, is_added)

    def drain_cache_events(self) -> tuple[list[int], list[int]]:
        """(hashes added, hashes removed) since the last drain, as net changes: a hash added
        and evicted in between is in neither list. Empty until `enable_cache_events`."""
        return self._cache_events.drain() if self._cache_events is not None else ([], [])

    def cached_hashes(self) -> list[int]:
        """Every hash the prefix cache holds now, in use or evictable (for a full republish)."""
        return list(self.hash_to_block_id)

    # ---- allocation -----------------------------------------------------------

    def _take_free_block(self) -> int:
        """The next block to evict: a single page has no run to keep."""
        return self._take_free_blocks(1)[0]

    def _claim(self, block_id: int) -> int:
        """Take free `block_id` out of the queue as a page held once."""
        self.free_block_ids.remove(block_id)
        block = self.blocks[block_id]
        if block.hash is not None:
            # Lazy eviction: the cached content is forgotten only now that the page is reused.
            self._uncache(block)
        block.chances = 0
        block.ref_count = 1
        return block_id

    def _take_free_blocks(self, n: int) -> list[int]:
        """The next `n` blocks to evict, in ascending id order. Which pages a prompt gets
        does not matter to the cache; their order does to copies of them: ascending ids on both
        ends of a KV transfer make runs that copy as one slice each."""
        if n > self.num_free_blocks:
            raise RuntimeError("no free KV block: check can_allocate/can_append_slot/can_fork first")
        return sorted(self._claim(b) for b in self.free_block_ids.next_to_evict(n))

    def _take_free_runs(self, n: int) -> list[int]:
        """`n` free blocks in few runs of consecutive ids, ascending: for a reservation, which a
        KV transfer fills.

        Why: a transfer copies one slice per run consecutive on both ends (`page_copy.block_runs`),
        and in the `[L, 2, Hkv, N, bs, D]` pool a block is only bs*D*itemsize bytes per (layer,
        K/V, head) row, so a scattered list becomes many small copies. Strict LRU scatters them:
        requests free their pages at different times, so the queue head mixes ids from everywhere
        (bench/mesh_overhead.py, after its TTFT traffic: 64 MiB into 9 decode reservations took
        61 runs, 46 this way. Copying 1024 demo-model blocks into a shared-memory pool, 61 runs
        measured 0.58-0.73 of a memcpy against 0.73-0.87 for one run, on a quiet host).

        Policy: the candidates are the next 2n blocks in eviction order; of them, whole runs are
        taken longest first, then the shortest run that covers the rest (ties: the run holding
        the older block); when no two candidates are consecutive this is exactly the next n.
        Only reservations look this deep: a prompt's own pages come strictly from the head, so the
        prefix cache never loses a block that the eviction order would keep.
        Raises RuntimeError, changing nothing, when fewer than `n` blocks are free.
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"{n} free KV blocks wanted, {self.num_free_blocks} free: check can_reserve first")
        if n <= 1:
            return self._take_free_blocks(n)
        candidates = self.free_block_ids.next_to_evict(min(2 * n, self.num_free_blocks))
        chosen = set(fewest_runs(candidates, n))
        # Evicted least recently freed first, as strict LRU would record them.
        return sorted(self._claim(b) for b in candidates if b in chosen)

    def _num_revived(self, block_ids: list[int]) -> int:
        """Matched blocks that sit in the free queue: they need no fresh block but leave the pool."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def can_allocate(self, seq: Sequence) -> bool:
        matched, _ = self._match(seq.token_ids, self._max_blocks_read(seq), seq.sampling_params.lora_name)
        return seq.num_blocks - len(matched) <= self.num_free_blocks - self._num_revived(matched)

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence without pages (new or preempted) its cached prefix plus fresh blocks.

        Sets `block_table`, and `num_cached_tokens = num_computed_tokens` to the matched tokens.
        """
        if seq.block_table or seq.request_id in self._seqs:
            raise ValueError(f"{seq.request_id!r} already holds blocks")
        matched, hashes = self._match(seq.token_ids, self._max_blocks_read(seq), seq.sampling_params.lora_name)
        num_fresh = seq.num_blocks - len(matched)
        if num_fresh > self.num_free_blocks - self._num_revived(matched):
            raise RuntimeError(f"not enough free KV blocks for {seq.request_id!r}")
        # Claim the matched blocks before taking fresh ones, so no fresh
        # allocation can evict a block this sequence is about to share.
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_block_ids.remove(block_id)
            block.ref_count += 1
            block.chances = min(MAX_CHANCES, block.chances + 1)
        seq.block_table = matched + self._take_free_blocks(num_fresh)
        seq.num_cached_tokens = seq.num_computed_tokens = len(matched) * self.block_size
        self._seqs[seq.request_id] = seq
        self._seq_hashes[seq.request_id] = hashes
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens

    def _num_append_blocks(self, seq: Sequence) -> int:
        # Shared blocks about to be written need a private copy; missing slots need a block.
        to_write = seq.block_table[seq.num_computed_tokens // self.block_size :]
        num_shared = sum(1 for b in to_write if self.blocks[b].ref_count > 1)
        return num_shared + max(0, seq.num_blocks - len(seq.block_table))

    def can_append_slot(self, seq: Sequence) -> bool:
        return self._num_append_blocks(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> CopyPairs:
        """Make every uncomputed token of `seq` writable: a slot for each, none shared.

        Returns the (src, dst) copies for blocks that were shared (after a fork)
        and are now private to `seq`; usually empty.
        """
        if seq.request_id not in self._seqs:
            raise ValueError(f"{seq.request_id!r} holds no blocks: allocate it first")
        if self._num_append_blocks(seq) > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks to append to {seq.request_id!r}")
        table = seq.block_table
        copies: CopyPairs = []
        for i in range(seq.num_computed_tokens // self.block_size, len(table)):
            src = self.blocks[table[i]]
            if src.ref_count > 1:  # copy-on-write
                src.ref_count -= 1
                table[i] = self._take_free_block()
                copies.append((src.block_id, table[i]))
        # Usually one block, the LRU head; several (a long chunk) come as runs.
        table.extend(self._take_free_blocks(max(0, seq.num_blocks - len(table))))
        return copies

    def can_fork(self, parent: Sequence) -> bool:
        # Only the partially filled tail needs a fresh block.
        return max(0, len(parent.block_table) - parent.num_full_blocks) <= self.num_free_blocks

    def fork(self, parent: Sequence, child: Sequence) -> CopyPairs:
        """Give `child` (same tokens as `parent`, no pages) the parent's KV.

        Full blocks are shared; the partially filled tail is copied into a
        fresh block. Returns the (src, dst) copies.
        """
        if parent.request_id not in self._seqs:
            raise ValueError(f"{parent.request_id!r} holds no blocks")
        if child.block_table or child.request_id in self._seqs:
            raise ValueError(f"{child.request_id!r} already holds blocks")
        if child.token_ids != parent.token_ids:
            raise ValueError("a forked child must start with its parent's tokens")
        if not self.can_fork(parent):
            raise RuntimeError(f"not enough free KV blocks to fork {parent.request_id!r}")
        num_shared = min(parent.num_full_blocks, len(parent.block_table))
        table = parent.block_table[:num_shared]
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        copies: CopyPairs = []
        for src in parent.block_table[num_shared:]:
            table.append(self._take_free_block())
            copies.append((src, table[-1]))
        child.block_table = table
        child.num_computed_tokens = parent.num_computed_tokens
        self._seqs[child.request_id] = child
        self._seq_hashes[child.request_id] = self._seq_hashes[parent.request_id][:num_shared]
        return copies

    def free(self, seq: Sequence) -> None:
        """Release a sequence's pages; a no-op for one that holds none."""
        held = self._seqs.pop(seq.request_id, None)
        if held is None:
            return
        del self._seq_hashes[seq.request_id]
        # Reverse order: a prefix's tail is evicted before its head, which more
        # requests share.
        for block_id in reversed(held.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.push(block_id)
        held.block_table = []

    # ---- reservations -----------------------------------------------------------

    def can_reserve(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def reserve(self, reservation_id: str, num_blocks: int) -> list[int]:
        """Set `num_blocks` fresh pages aside under `reservation_id`; returns their ids."""
        if reservation_id in self._reservations or reservation_id in self._seqs:
            raise ValueError(f"{reservation_id!r} already holds blocks")
        if not self.can_reserve(num_blocks):
            raise RuntimeError(f"not enough free KV blocks to reserve {num_blocks} for {reservation_id!r}")
        block_ids = self._take_free_runs(num_blocks)
        self._reservations[reservation_id] = block_ids
        return block_ids

    def release(self, reservation_id: str) -> bool:
        """Give back reserved pages nobody adopted (lease expiry, abort). False if unknown."""
        block_ids = self._reservations.pop(reservation_id, None)
        if block_ids is None:
            return False
        for block_id in reversed(block_ids):
            self.blocks[block_id].ref_count = 0
            self.free_block_ids.push(block_id)
        return True

    def adopt(self, reservation_id: str, seq: Sequence) -> None:
        """Make the reserved pages `seq`'s leading blocks, their KV already written for
        its first `seq.num_computed_tokens` tokens. Full blocks join the prefix cache."""
        if seq.block_table or seq.request_id in self._seqs:
            raise ValueError(f"{seq.request_id!r} already holds blocks")
        block_ids = self._reservations.get(reservation_id)
        if block_ids is None:
            raise ValueError(f"no reservation {reservation_id!r}")
        if len(block_ids) * self.block_size < seq.num_computed_tokens:
            raise ValueError(
                f"reservation {reservation_id!r} holds {len(block_ids)} blocks, too few for "
                f"{seq.num_computed_tokens} computed tokens"
            )
        del self._reservations[reservation_id]
        seq.block_table = block_ids
        self._seqs[seq.request_id] = seq
        self._seq_hashes[seq.request_id] = []
        self.cache_computed_blocks(seq)

    # ---- blocks computed elsewhere ------------------------------------------------

    def import_cached_blocks(self, token_ids: TokenIds[int], first_block: int,
                             num_blocks: int) -> list[tuple[int, int]]:
        """Name fresh pages as the cached blocks `first_block .. first_block + num_blocks - 1` of
        `token_ids`, whose KV another instance computed (read back from the host tier), so
        that the next `allocate` of a prompt with this prefix takes them instead of computing.

        Returns (block index, page id) for each block named, in order: the caller writes that
        block's KV into the page before anything else touches this manager (the same engine
        command), since the page is free and evictable like any cached block. Fewer are named
        when pages run short (no page of the cached prefix before `first_block` is evicted for
        them), none when that prefix is not all cached here (they would be unreachable), and a
        block already cached is skipped.
        """
        if not self.enable_prefix_caching or num_blocks < 1:
            return []
        matched, hashes = self._match(token_ids, first_block)
        if len(matched) < first_block:
            return []
        # The prefix these blocks extend leaves the queue while fresh pages are taken (so none of
        # it is evicted for them), then goes back to its tail.
        revived = [b for b in matched if self.blocks[b].ref_count == 0]
        for block_id in revived:
            self.free_block_ids.remove(block_id)
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        wanted: list[tuple[int, int, tuple[int, ...]]] = []  # (block index, hash, tokens)
        for i in range(first_block, min(first_block + num_blocks, len(token_ids) // bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens, self.hash_extra)
            if parent not in self.hash_to_block_id:
                wanted.append((i, parent, tokens))
        wanted = wanted[: self.num_free_blocks]
        named = list(zip((i for i, _, _ in wanted), self._take_free_blocks(len(wanted))))
        for block_id in revived:
            self.free_block_ids.push(block_id)
        for (_, h, tokens), (_, block_id) in zip(wanted, named):
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.ref_count = h, tokens, 0
            self.hash_to_block_id[h] = block_id
            self._record(h, True)
        # Back into the free queue tail first, as `free` does: a prefix's tail is evicted before its head.
        for _, block_id in reversed(named):
            self.free_block_ids.push(block_id)
        return named

    # ---- checking -------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first inconsistency between pages, tables and map."""
        held_by = [0] * self.num_blocks
        assert self._seq_hashes.keys() == self._seqs.keys(), "hash chains and held sequences disagree"
        for rid, seq in self._seqs.items():
            table, hashes = seq.block_table, self._seq_hashes[rid]
            assert len(set(table)) == len(table), f"{rid!r} holds a block twice: {table}"
            assert len(hashes) <= len(table), f"{rid!r}: {len(hashes)} hashes for {len(table)} blocks"
            for block_id, h in zip(table, hashes):
                assert self.blocks[block_id].hash in (None, h), f"{rid!r}: block {block_id} has another hash"
            for block_id in table:
                held_by[block_id] += 1
        for rid, block_ids in self._reservations.items():
            assert rid not in self._seqs, f"{rid!r} is both reserved and held by a sequence"
            for block_id in block_ids:
                held_by[block_id] += 1
        for block in self.blocks:
            b, ref, is_free = block.block_id, block.ref_count, block.block_id in self.free_block_ids
            assert ref == held_by[b], f"block {b}: ref_count {ref} but held by {held_by[b]} tables"
            assert (ref == 0) == is_free, f"block {b}: ref_count {ref} but in free queue: {is_free}"
            if block.hash is not None:
                assert self.hash_to_block_id.get(block.hash) == b, f"block {b}: its hash maps elsewhere"
        # The queue's ids are unique (an OrderedDict's keys), so no id is queued twice; the count rules out
        # unknown ids.
        assert len(self.free_block_ids) == held_by.count(0), "free queue holds unknown block ids"
        for h, b in self.hash_to_block_id.items():
            assert self.blocks[b].hash == h, f"hash {h:#x} maps to block {b}, which has {self.blocks[b].hash}"
