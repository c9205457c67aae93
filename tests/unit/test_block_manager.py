"""`BlockManager`: exact block ids, reference counts, eviction order and prefix hits."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_hash import hash_block_chain
from engine.block_manager import MAX_CHANCES, BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(rid: str, tokens) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), BS)


def compute(mgr: BlockManager, seq: Sequence, num_computed: int | None = None) -> None:
    """What the engine does after a step: the KV is in the pages, so register it."""
    seq.num_computed_tokens = seq.num_tokens if num_computed is None else num_computed
    mgr.cache_computed_blocks(seq)


def admitted(mgr: BlockManager, rid: str, tokens, computed: bool = False) -> Sequence:
    seq = make_seq(rid, tokens)
    mgr.allocate(seq)
    if computed:
        compute(mgr, seq)
    return seq


def refs(mgr: BlockManager) -> list[int]:
    return [b.ref_count for b in mgr.blocks]


def test_blocks_are_handed_out_in_order_and_freed_in_reverse_to_the_tail():
    mgr = BlockManager(8, BS)
    a, b = admitted(mgr, "a", range(10)), admitted(mgr, "b", [100])
    assert (a.block_table, b.block_table, mgr.num_free_blocks) == ([0, 1, 2], [3], 4)
    assert (a.num_cached_tokens, a.num_computed_tokens) == (0, 0)
    mgr.free(a)
    assert (list(mgr.free_block_ids), a.block_table) == ([4, 5, 6, 7, 2, 1, 0], [])
    mgr.free(b)
    assert list(mgr.free_block_ids) == [4, 5, 6, 7, 2, 1, 0, 3]
    mgr.free(b)  # already freed: no-op
    mgr.free(make_seq("never", [1]))  # unknown: no-op
    assert mgr.num_free_blocks == 8
    mgr.check_integrity()
    mgr.blocks[0].ref_count += 1
    with pytest.raises(AssertionError, match="block 0"):
        mgr.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_tokens():
    mgr = BlockManager(8, BS)
    a = admitted(mgr, "a", range(12), computed=True)
    assert [mgr.blocks[i].hash for i in range(3)] == hash_block_chain(a.token_ids, BS)
    b = admitted(mgr, "b", list(range(8)) + [50, 51, 52, 53])
    assert (b.block_table, b.num_cached_tokens, b.num_computed_tokens) == ([0, 1, 3], 8, 8)
    assert refs(mgr) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert (mgr.num_prefix_query_tokens, mgr.num_prefix_hit_tokens) == (24, 8)
    mgr.check_integrity()


def test_at_least_one_token_is_left_to_compute():
    mgr = BlockManager(8, BS)
    admitted(mgr, "a", range(8), computed=True)
    same = admitted(mgr, "same", range(8))  # (8 - 1) // 4 = 1 block may match
    assert (same.block_table, same.num_cached_tokens) == ([0, 2], 4)
    longer = admitted(mgr, "longer", range(9))  # (9 - 1) // 4 = 2 blocks may match
    assert (longer.block_table, longer.num_cached_tokens) == ([0, 1, 3], 8)
    assert mgr.num_cached_prefix_tokens(list(range(8))) == 4
    assert mgr.num_cached_prefix_tokens(list(range(9))) == 8
    assert mgr.num_cached_prefix_tokens([]) == 0


def test_freed_blocks_stay_cached_and_count_against_the_pool():
    mgr = BlockManager(4, BS)
    a, x = admitted(mgr, "a", range(12), computed=True), admitted(mgr, "x", [9])
    mgr.free(a)
    mgr.free(x)
    assert list(mgr.free_block_ids) == [2, 1, 0, 3]
    assert mgr.num_cached_prefix_tokens(list(range(13))) == 12
    # 5 blocks, 2 of them cached but free: 3 fresh > 4 free - 2 revived.
    assert not mgr.can_allocate(make_seq("c", list(range(8)) + [60] * 12))
    b = make_seq("b", list(range(8)) + [60] * 8)  # 2 cached + 2 fresh: fits exactly
    assert mgr.can_allocate(b)
    mgr.allocate(b)
    # The matched blocks leave the queue before fresh ones are taken from its head.
    assert (b.block_table, mgr.num_free_blocks) == ([0, 1, 2, 3], 0)
    assert mgr.num_cached_prefix_tokens(list(range(13))) == 8  # block 2 was reused
    mgr.check_integrity()


def test_a_reset_forgets_every_cached_block_only_when_no_page_is_held():
    mgr = BlockManager(8, BS)
    mgr.enable_cache_events()
    a = admitted(mgr, "a", range(12), computed=True)
    assert mgr.reset_prefix_cache() is None  # "a" holds its pages
    assert mgr.num_cached_prefix_tokens(list(range(13))) == 12
    mgr.free(a)
    mgr.drain_cache_events()
    assert mgr.reset_prefix_cache() == 3
    assert mgr.num_cached_prefix_tokens(list(range(13))) == 0 and mgr.num_free_blocks == 8
    assert mgr.drain_cache_events() == ([], hash_block_chain(list(range(12)), BS))  # for the prefix index
    assert mgr.reset_prefix_cache() == 0
    mgr.check_integrity()


def test_lru_eviction_drops_the_hash_on_reuse():
    mgr = BlockManager(4, BS)
    a = admitted(mgr, "a", range(9), computed=True)
    h1 = mgr.blocks[1].hash
    mgr.free(a)
    assert list(mgr.free_block_ids) == [3, 2, 1, 0]
    # The three least recently freed (3, 2, 1), handed out in ascending order.
    assert admitted(mgr, "x", [70] * 12).block_table == [1, 2, 3]
    assert h1 not in mgr.hash_to_block_id
    assert (mgr.blocks[1].hash, mgr.blocks[1].token_ids) == (None, ())
    assert mgr.num_cached_prefix_tokens(list(range(9))) == 4  # block 0 survives
    mgr.check_integrity()


def test_a_block_that_served_a_hit_outlives_newer_blocks_never_hit():
    mgr = BlockManager(6, BS)
    system = list(range(8))  # two full blocks every request shares
    mgr.free(admitted(mgr, "first", system + [50], computed=True))  # blocks 0, 1 and partial 2
    again = admitted(mgr, "again", system + [60])  # hits 0 and 1
    assert again.block_table == [0, 1, 3]
    mgr.free(again)
    mgr.free(admitted(mgr, "other", [70] * 5, computed=True))  # a prompt nobody repeats: 4, 5
    assert list(mgr.free_block_ids) == [2, 3, 1, 0, 5, 4]
    # Strict LRU would take 2, 3 and the system prompt's 1; the second chance moves 1 and 0
    # to the back and takes `other`'s 5, never hit.
    assert admitted(mgr, "new", [80] * 12).block_table == [2, 3, 5]
    assert list(mgr.free_block_ids) == [4, 1, 0]
    assert mgr.num_cached_prefix_tokens(system + [90]) == 8
    mgr.check_integrity()


def test_a_prefix_hit_once_and_not_again_within_one_pass_is_evicted():
    mgr = BlockManager(6, BS)
    mgr.free(admitted(mgr, "hot", range(9), computed=True))
    hit = admitted(mgr, "hit", range(9))  # blocks 0 and 1 hit once
    cold = admitted(mgr, "cold", [70] * 8)
    mgr.free(hit)
    mgr.free(cold)
    assert list(mgr.free_block_ids) == [2, 3, 1, 0, 5, 4]
    mgr.free(admitted(mgr, "x", [71] * 12))  # passes over 0 and 1: spared, bits cleared
    assert mgr.num_cached_prefix_tokens(range(9)) == 8
    assert not any(b.chances for b in mgr.blocks)
    assert list(mgr.free_block_ids) == [4, 1, 0, 5, 3, 2]
    # Not hit since: the next pass evicts them like any block; a cold prefix pins nothing.
    assert admitted(mgr, "y", [72] * 16).block_table == [0, 1, 4, 5]
    assert mgr.num_cached_prefix_tokens(range(9)) == 0
    mgr.check_integrity()


def test_when_every_block_passed_has_chances_the_next_pass_goes_in_queue_order():
    mgr = BlockManager(3, BS)
    mgr.free(admitted(mgr, "a", range(12), computed=True))
    b = admitted(mgr, "b", range(12), computed=True)  # hits blocks 0 and 1, takes 2 afresh
    mgr.free(b)
    assert (list(mgr.free_block_ids), [blk.chances for blk in mgr.blocks]) == ([2, 1, 0], [1, 1, 0])
    assert admitted(mgr, "c", [99] * 8).block_table == [1, 2]
    assert (list(mgr.free_block_ids), mgr.blocks[0].chances) == ([0], 0)
    assert mgr.num_cached_prefix_tokens(range(12)) == 4
    mgr.check_integrity()


def test_each_hit_buys_one_more_pass_up_to_max_chances():
    mgr = BlockManager(4, BS)
    mgr.free(admitted(mgr, "hot", range(5), computed=True))  # block 0 cached
    for i in range(MAX_CHANCES + 2):
        mgr.free(admitted(mgr, f"hit-{i}", range(5)))
    assert mgr.blocks[0].chances == MAX_CHANCES
    mgr.free(admitted(mgr, "fill", [79] * 12))  # the three blocks ahead of block 0: no pass
    assert (next(iter(mgr.free_block_ids)), mgr.blocks[0].chances) == (0, MAX_CHANCES)
    for i in range(MAX_CHANCES):  # each takes every block but 0, passing it at the head
        mgr.free(admitted(mgr, f"pass-{i}", [80 + i] * 12))
        assert (mgr.num_cached_prefix_tokens(range(5)), mgr.blocks[0].chances) == (4, MAX_CHANCES - 1 - i)
    mgr.free(admitted(mgr, "last", [90] * 4))
    assert mgr.num_cached_prefix_tokens(range(5)) == 0
    mgr.check_integrity()


def test_a_hash_hit_with_other_tokens_is_a_miss():
    mgr = BlockManager(8, BS)
    admitted(mgr, "a", range(9), computed=True)
    mgr.blocks[0].token_ids = (9, 9, 9, 9)  # as if another block had collided on this hash
    assert mgr.num_cached_prefix_tokens(list(range(9))) == 0
    b = admitted(mgr, "b", range(9))
    assert (b.block_table, b.num_cached_tokens) == ([3, 4, 5], 0)


def test_only_full_computed_blocks_are_registered_including_decoded_ones():
    mgr = BlockManager(8, BS)
    a = admitted(mgr, "a", range(10))
    compute(mgr, a, 6)
    assert [b.hash is not None for b in mgr.blocks[:3]] == [True, False, False]
    compute(mgr, a)
    assert [b.hash is not None for b in mgr.blocks[:3]] == [True, True, False]
    for token in (10, 11, 12):
        a.append_token(token)
        assert mgr.can_append_slot(a)
        mgr.append_slot(a)
        compute(mgr, a)
    assert a.block_table == [0, 1, 2, 3]  # a block is added only on the boundary
    assert [mgr.blocks[i].hash for i in a.block_table[:3]] == hash_block_chain(list(range(12)), BS)
    assert (mgr.blocks[2].token_ids, mgr.blocks[3].hash) == ((8, 9, 10, 11), None)
    mgr.check_integrity()


def test_identical_content_keeps_the_first_registration():
    mgr = BlockManager(8, BS)
    a, b = admitted(mgr, "a", range(9)), admitted(mgr, "b", range(9))
    assert b.block_table == [3, 4, 5]  # nothing cached yet: fresh blocks
    compute(mgr, a)
    compute(mgr, b)
    assert sorted(mgr.hash_to_block_id.values()) == [0, 1]
    assert [mgr.blocks[i].hash for i in b.block_table] == [None, None, None]
    mgr.check_integrity()


def test_out_of_blocks_raises_before_changing_anything():
    mgr = BlockManager(2, BS)
    a = make_seq("a", range(12))
    assert not mgr.can_allocate(a)
    with pytest.raises(RuntimeError):
        mgr.allocate(a)
    assert (a.block_table, mgr.num_free_blocks) == ([], 2)
    b = admitted(mgr, "b", range(8))
    b.append_token(8)
    assert not mgr.can_append_slot(b)
    with pytest.raises(RuntimeError):
        mgr.append_slot(b)
    mgr.check_integrity()


def test_a_hybrid_models_sequence_holds_state_pages_beside_its_tokens():
    """Each sequence of a hybrid model takes `num_state_blocks` pages of its own for its recurrent states: counted
    before it is admitted, handed over with a reservation (its last pages), freed."""
    mgr = BlockManager(12, BS, enable_prefix_caching=False, num_state_blocks=2)
    assert not mgr.can_allocate(make_seq("big", range(4 * 11)))  # 11 pages of tokens, 2 of states: 13 of 12
    a = admitted(mgr, "a", range(6), computed=True)
    assert (a.block_table, a.state_blocks) == ([0, 1], [2, 3])
    assert mgr.reserve("r", 3 + 2) == [4, 5, 6, 7, 8]  # a 12-token prompt's pages and its states'
    seq = make_seq("r", range(12))
    seq.num_computed_tokens = 12
    mgr.adopt("r", seq)
    assert (seq.block_table, seq.state_blocks) == ([4, 5, 6], [7, 8])
    mgr.check_integrity()
    for held in (a, seq):
        mgr.free(held)
    assert mgr.num_free_blocks == 12 and refs(mgr) == [0] * 12
    mgr.check_integrity()


def interleaved(mgr: BlockManager, rids, num_blocks: int) -> list[Sequence]:
    """Sequences decoding side by side, each taking one page per step: their pages interleave."""
    seqs = [admitted(mgr, rid, [7]) for rid in rids]
    for _ in range(num_blocks - 1):
        for seq in seqs:
            compute(mgr, seq)
            seq.append_token(7)
            seq.token_ids[len(seq.token_ids):] = [7] * (BS - 1)  # up to the next block's first slot
            mgr.append_slot(seq)
    return seqs


def test_a_reservation_after_interleaved_decoding_is_one_run():
    mgr = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = interleaved(mgr, ["a", "b"], 4)
    assert (a.block_table, b.block_table) == ([0, 2, 4, 6], [1, 3, 5, 7])
    mgr.free(a)
    mgr.free(b)
    assert list(mgr.free_block_ids) == [6, 4, 2, 0, 7, 5, 3, 1]
    # Strict LRU would give [0, 2, 4, 6]: four runs, four small copies per (layer, K/V, head)
    # row. Of the 8 least recently freed, the 4-long stretch freed earliest.
    assert mgr.reserve("r", 4) == [4, 5, 6, 7]
    assert list(mgr.free_block_ids) == [2, 0, 3, 1]
    assert mgr.reserve("s", 4) == [0, 1, 2, 3]
    mgr.check_integrity()


def test_runs_are_taken_only_among_the_2n_least_recently_freed():
    mgr = BlockManager(16, BS)
    a, _ = interleaved(mgr, ["a", "b"], 4)
    c = admitted(mgr, "c", range(100, 132), computed=True)
    assert c.block_table == list(range(8, 16))
    mgr.free(a)
    mgr.free(c)  # the freshest: a long run, but its cached prefix is the last to go
    assert list(mgr.free_block_ids) == [6, 4, 2, 0, *range(15, 7, -1)]
    # No two of the 4 oldest are consecutive: the LRU head, as strict LRU takes it.
    assert mgr.reserve("r", 2) == [4, 6]
    assert mgr.num_cached_prefix_tokens(list(range(100, 133))) == 32
    # 6 blocks: candidates 2, 0 and the 10 oldest of c's pages (15 .. 6 of them): the run.
    assert mgr.reserve("s", 6) == list(range(10, 16))
    assert mgr.num_cached_prefix_tokens(list(range(100, 133))) == 8  # c's blocks 8, 9 survive
    mgr.check_integrity()


def test_unconsecutive_candidates_are_taken_in_lru_order():
    mgr = BlockManager(16, BS)
    a, _, c, _ = seqs = interleaved(mgr, ["a", "b", "c", "d"], 4)
    for seq in seqs:
        compute(mgr, seq)
    mgr.free(c)
    mgr.free(a)
    assert list(mgr.free_block_ids) == [14, 10, 6, 2, 12, 8, 4, 0]
    # No two of the 6 oldest are consecutive: the 3 oldest, as strict LRU takes them.
    assert mgr.reserve("r", 3) == [6, 10, 14]
    assert list(mgr.free_block_ids) == [2, 12, 8, 4, 0]
    mgr.check_integrity()


def test_a_run_request_over_the_free_pool_raises_before_changing_anything():
    mgr = BlockManager(8, BS)
    a = admitted(mgr, "a", range(16), computed=True)  # 0..3, cached
    mgr.free(a)
    assert list(mgr.free_block_ids) == [4, 5, 6, 7, 3, 2, 1, 0]
    with pytest.raises(RuntimeError):
        mgr.pool.take_free_runs(9)
    assert list(mgr.free_block_ids) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert mgr.num_cached_prefix_tokens(list(range(17))) == 16


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / step / fork / free / preempt against a model of what each page holds.

    `pages` keeps stale tokens when a block is reused, as GPU memory would;
    every computed token of a live sequence and every cached block must be
    found in its page.
    """

    enable_prefix_caching = True
    num_blocks = 12

    def __init__(self) -> None:
        super().__init__()
        self.mgr = BlockManager(self.num_blocks, BS, b"fp", self.enable_prefix_caching)
        self.pages: list[list[int | None]] = [[None] * BS for _ in range(self.num_blocks)]
        self.live: dict[str, Sequence] = {}
        self.preempted: list[Sequence] = []
        self.reserved: dict[str, list[int]] = {}
        self.ids = itertools.count()

    def _admit(self, seq: Sequence) -> bool:
        if not self.mgr.can_allocate(seq):
            return False
        self.mgr.allocate(seq)
        assert seq.num_computed_tokens == seq.num_cached_tokens
        assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < seq.num_tokens
        assert len(seq.block_table) == seq.num_blocks
        assert self.enable_prefix_caching or seq.num_cached_tokens == 0
        self.live[seq.request_id] = seq
        return True

    # Common prefixes and a three-token alphabet make hits and duplicate blocks likely.
    @rule(
        prefix=st.sampled_from([[], [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 2, 2, 2, 2, 1]]),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    )
    def admit(self, prefix, suffix):
        self._admit(make_seq(f"r{next(self.ids)}", prefix + suffix))

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit(self, data):
        seq = data.draw(st.sampled_from(self.preempted))
        if self._admit(seq):
            self.preempted.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def step(self, data, token):
        """Prefill a chunk, or decode: sample a token, then compute it."""
        seq = data.draw(st.sampled_from(list(self.live.values())))
        if not seq.num_uncomputed_tokens:
            seq.append_token(token)
        if not self.mgr.can_append_slot(seq):
            return
        self.mgr.append_slot(seq)
        num_new = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = self.mgr.blocks[seq.block_table[pos // BS]]
            assert block.ref_count == 1 and block.hash is None, f"{seq} writes a shared or cached page"
            self.pages[block.block_id][pos % BS] = seq.token_ids[pos]
        seq.num_computed_tokens += num_new
        self.mgr.cache_computed_blocks(seq)

    @rule(n=st.integers(1, 4))
    def reserve(self, n):
        if not self.mgr.can_reserve(n):
            return
        rid = f"r{next(self.ids)}"
        block_ids = self.mgr.reserve(rid, n)
        assert block_ids == sorted(set(block_ids)) and len(block_ids) == n
        for block_id in block_ids:
            assert (self.mgr.blocks[block_id].ref_count, self.mgr.blocks[block_id].hash) == (1, None)
        self.reserved[rid] = block_ids

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), adopt=st.booleans())
    def settle(self, data, adopt):
        """Adopt a reservation whose KV another worker wrote, or release it."""
        rid = data.draw(st.sampled_from(sorted(self.reserved)))
        block_ids = self.reserved.pop(rid)
        if not adopt:
            assert self.mgr.release(rid)
            return
        n = data.draw(st.integers((len(block_ids) - 1) * BS + 1, len(block_ids) * BS))
        seq = make_seq(rid, data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
        seq.num_computed_tokens = n
        for pos, token in enumerate(seq.token_ids):
            self.pages[block_ids[pos // BS]][pos % BS] = token
        self.mgr.adopt(rid, seq)
        self.live[rid] = seq

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        """Finish, abort (possibly mid-prefill) or preempt a sequence."""
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.mgr.free(seq)
        self.mgr.free(seq)  # a second free is a no-op
        if preempt:
            seq.num_computed_tokens = 0
            self.preempted.append(seq)

    @invariant()
    def consistent(self):
        self.mgr.check_integrity()
        for seq in self.live.values():
            for pos in range(seq.num_computed_tokens):
                page = self.pages[seq.block_table[pos // BS]]
                assert page[pos % BS] == seq.token_ids[pos], f"{seq}: wrong KV at position {pos}"
        for block in self.mgr.blocks:
            if block.hash is not None:
                assert tuple(self.pages[block.block_id]) == block.token_ids, f"block {block.block_id} lies"
        if not self.enable_prefix_caching:
            assert not self.mgr.hash_to_block_id

    def teardown(self):
        for seq in self.live.values():
            self.mgr.free(seq)
        for rid in self.reserved:
            self.mgr.release(rid)
        self.mgr.check_integrity()
        assert self.mgr.num_free_blocks == self.num_blocks


class NoPrefixCachingMachine(BlockManagerMachine):
    enable_prefix_caching = False


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestNoPrefixCachingStateful = NoPrefixCachingMachine.TestCase
TestNoPrefixCachingStateful.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


def test_forgetting_an_adapter_uncaches_exactly_its_blocks_and_says_so():
    mgr = BlockManager(8, BS)
    mgr.enable_cache_events()
    base = admitted(mgr, "base", range(8), computed=True)
    tuned = Sequence("tuned", list(range(8)), SamplingParams(lora_name="x"), BS)
    mgr.allocate(tuned)
    compute(mgr, tuned)
    other = Sequence("other", list(range(8)), SamplingParams(lora_name="y"), BS)
    mgr.allocate(other)
    compute(mgr, other)
    base_hashes, x_hashes, y_hashes = (hash_block_chain(range(8), BS, mgr.prefix_cache.extra(name))
                                       for name in (None, "x", "y"))
    mgr.drain_cache_events()
    mgr.free(tuned)
    mgr.forget_adapter("x")
    assert mgr.drain_cache_events() == ([], x_hashes)
    assert sorted(mgr.cached_hashes()) == sorted(base_hashes + y_hashes)
    assert [mgr.blocks[b].hash for b in (2, 3)] == [None, None]
    assert mgr.num_cached_prefix_tokens(list(range(9)), "x") == 0
    assert mgr.num_cached_prefix_tokens(list(range(9)), "y") == 8
    mgr.free(base), mgr.free(other)
    mgr.check_integrity()


def test_a_salted_prefix_is_shared_only_with_its_salt():
    """vLLM's cache_salt: blocks cached under a salt match only requests giving that salt, in
    both directions; unsalted ones share among themselves."""
    mgr = BlockManager(16, BS)
    mgr.enable_cache_events()
    seqs: dict[str, Sequence] = {}

    def cached(rid: str, salt: str | None) -> int:
        seqs[rid] = Sequence(rid, list(range(9)), SamplingParams(cache_salt=salt), BS)
        mgr.allocate(seqs[rid])
        return seqs[rid].num_cached_tokens

    assert cached("a1", "tenant-a") == 0
    compute(mgr, seqs["a1"])
    assert mgr.drain_cache_events()[0] == hash_block_chain(range(8), BS, mgr.prefix_cache.extra(None, "tenant-a"))
    assert [cached("b", "tenant-b"), cached("plain", None), cached("a2", "tenant-a")] == [0, 0, 8]
    assert mgr.num_cached_prefix_tokens(list(range(9))) == 0  # the unsalted view: the host tier's
    mgr.free(seqs.pop("a1"))
    compute(mgr, seqs["plain"])
    assert [cached("plain2", None), cached("c", "tenant-c")] == [8, 0]
    for seq in seqs.values():
        mgr.free(seq)
    mgr.check_integrity()


def test_an_empty_salt_is_refused():
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")
