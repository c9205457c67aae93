"""`BlockManager` cache events: what a prefix index outside the process learns, as net
changes between drains, and the full set for a republish."""
from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import invariant, rule

from engine.block_hash import hash_block_chain
from engine.block_manager import BlockManager
from tests.unit.test_block_manager import BS, BlockManagerMachine, admitted, compute, make_seq


def test_nothing_is_recorded_until_enabled():
    mgr = BlockManager(4, BS)
    admitted(mgr, "a", range(9), computed=True)
    assert mgr.drain_cache_events() == ([], [])
    assert mgr.cached_hashes() == hash_block_chain(list(range(9)), BS)
    assert mgr.prefix_cache.events is None  # nothing grows when nobody drains


def test_registered_blocks_are_added_and_evicted_ones_removed():
    mgr = BlockManager(4, BS)
    mgr.enable_cache_events()
    a = admitted(mgr, "a", range(9), computed=True)  # blocks 0, 1 full; block 2 partial
    h0, h1 = hash_block_chain(list(range(9)), BS)
    assert mgr.drain_cache_events() == ([h0, h1], [])
    assert mgr.drain_cache_events() == ([], [])  # drained
    mgr.free(a)  # freed pages keep their hashes: still cached, nothing removed
    assert mgr.drain_cache_events() == ([], [])
    # Free queue [3, 2, 1, 0]: four fresh pages reuse (evict) block 1, then block 0.
    admitted(mgr, "b", [100] * 13)
    assert mgr.drain_cache_events() == ([], [h1, h0])
    assert mgr.cached_hashes() == []


def test_an_add_and_evict_in_one_window_leaves_nothing():
    mgr = BlockManager(2, BS)
    mgr.enable_cache_events()
    a = admitted(mgr, "a", range(5), computed=True)
    mgr.free(a)
    admitted(mgr, "b", [100] * 8)  # evicts a's one cached block
    assert mgr.drain_cache_events() == ([], [])


def test_an_evict_and_readd_in_one_window_leaves_nothing():
    mgr = BlockManager(2, BS)
    mgr.enable_cache_events()
    a = admitted(mgr, "a", range(5), computed=True)
    (h0,) = hash_block_chain(list(range(5)), BS)
    assert mgr.drain_cache_events() == ([h0], [])
    mgr.free(a)
    b = admitted(mgr, "b", [100] * 8)  # evicts h0
    mgr.free(b)
    again = admitted(mgr, "again", range(5), computed=True)  # h0 registered anew
    assert mgr.drain_cache_events() == ([], [])  # published before, published still
    assert h0 in mgr.cached_hashes()
    mgr.free(again)


def test_adopted_pages_are_added():
    mgr = BlockManager(4, BS)
    mgr.enable_cache_events()
    mgr.reserve("r", 3)
    seq = make_seq("r", range(10))
    seq.num_computed_tokens = 10
    mgr.adopt("r", seq)
    assert mgr.drain_cache_events() == (hash_block_chain(list(range(10)), BS), [])


def test_a_duplicate_block_is_not_added_twice():
    mgr = BlockManager(8, BS)
    mgr.enable_cache_events()
    a = admitted(mgr, "a", range(5))
    b = admitted(mgr, "b", range(5))  # same prompt, neither computed yet: no hit
    compute(mgr, a)
    compute(mgr, b)  # same content: the map keeps a's block, b's page stays unnamed
    assert mgr.drain_cache_events() == (hash_block_chain(list(range(5)), BS), [])


class CacheEventsMachine(BlockManagerMachine):
    """The block manager machine, with a mirror fed only by drained events: after every
    drain it holds exactly the hashes the cache holds."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr.enable_cache_events()
        self.published: set[int] = set()

    @rule()
    def drain(self):
        added, removed = self.mgr.drain_cache_events()
        assert not set(added) & self.published, "a hash published twice"
        assert set(removed) <= self.published, "a hash removed that was never published"
        self.published = (self.published - set(removed)) | set(added)
        assert self.published == set(self.mgr.cached_hashes())

    @invariant()
    def events_are_net_changes(self):
        events = self.mgr.prefix_cache.events
        cached = set(self.mgr.hash_to_block_id)
        for h, is_added in events.items():
            assert is_added == (h in cached) and is_added != (h in self.published)


TestCacheEventsStateful = CacheEventsMachine.TestCase
TestCacheEventsStateful.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_undrained_events_stay_bounded_by_twice_the_pool():
    mgr = BlockManager(4, BS)
    mgr.enable_cache_events()
    for i in range(50):  # every prompt evicts the previous ones
        seq = admitted(mgr, f"r{i}", [1000 + i] * (4 * BS - 1), computed=True)
        mgr.free(seq)
        assert len(mgr.prefix_cache.events) <= 2 * mgr.num_blocks
