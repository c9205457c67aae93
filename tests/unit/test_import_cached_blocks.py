"""`BlockManager.import_cached_blocks`: blocks computed elsewhere (read back from the host
tier) become cached pages that the next allocation of their prefix takes."""
from __future__ import annotations

from engine.block_hash import hash_block_chain
from engine.block_manager import BlockManager
from tests.unit.test_block_manager import BS, admitted

PROMPT = list(range(100, 100 + 5 * BS + 2))  # five full blocks and a partial one


def test_imported_blocks_are_matched_by_the_next_allocation():
    mgr = BlockManager(16, BS)
    mgr.enable_cache_events()
    named = mgr.import_cached_blocks(PROMPT, 0, 4)
    assert [i for i, _ in named] == [0, 1, 2, 3]
    assert len({b for _, b in named}) == 4
    assert mgr.num_free_blocks == 16  # cached but unreferenced: evictable like any freed block
    assert mgr.drain_cache_events() == (hash_block_chain(PROMPT, BS)[:4], [])
    seq = admitted(mgr, "a", PROMPT)
    assert seq.num_cached_tokens == 4 * BS
    assert seq.block_table[:4] == [b for _, b in named]
    mgr.check_integrity()


def test_import_extends_a_cached_prefix_and_skips_what_is_cached():
    mgr = BlockManager(16, BS)
    a = admitted(mgr, "a", PROMPT[: 2 * BS + 1], computed=True)  # blocks 0 and 1 cached here
    mgr.free(a)
    named = mgr.import_cached_blocks(PROMPT, 1, 4)  # block 1 is cached already: only 2..4
    assert [i for i, _ in named] == [2, 3, 4]
    assert mgr.num_cached_prefix_tokens(PROMPT) == 5 * BS
    mgr.check_integrity()


def test_nothing_is_imported_without_the_prefix_it_extends():
    mgr = BlockManager(16, BS)
    assert mgr.import_cached_blocks(PROMPT, 2, 3) == []  # blocks 0, 1 are not cached here
    assert mgr.num_cached_prefix_tokens(PROMPT) == 0
    mgr.check_integrity()


def test_import_never_evicts_the_prefix_it_extends_and_stops_when_pages_run_short():
    mgr = BlockManager(4, BS)
    a = admitted(mgr, "a", PROMPT[: 2 * BS + 1], computed=True)  # 3 pages: blocks 0, 1 and a partial
    mgr.free(a)  # all 4 free; blocks 0 and 1 cached
    named = mgr.import_cached_blocks(PROMPT, 2, 3)
    assert [i for i, _ in named] == [2, 3]  # 2 pages are not the prefix's: block 4 does not fit
    assert mgr.num_cached_prefix_tokens(PROMPT) == 4 * BS
    mgr.check_integrity()


def test_a_busy_pool_imports_nothing_and_a_disabled_cache_never_does():
    mgr = BlockManager(2, BS)
    admitted(mgr, "a", range(2 * BS))
    assert mgr.import_cached_blocks(PROMPT, 0, 3) == []
    mgr.check_integrity()
    assert BlockManager(8, BS, enable_prefix_caching=False).import_cached_blocks(PROMPT, 0, 3) == []


def test_salted_blocks_are_imported_for_their_salt_only():
    from engine.block_hash import request_extra

    mgr = BlockManager(16, BS)
    mgr.enable_cache_events()
    named = mgr.import_cached_blocks(PROMPT, 0, 3, cache_salt="tenant")
    assert [i for i, _ in named] == [0, 1, 2]
    assert mgr.drain_cache_events() == (hash_block_chain(PROMPT, BS, request_extra(b"", None, "tenant"))[:3], [])
    assert mgr.num_cached_prefix_tokens(PROMPT, cache_salt="tenant") == 3 * BS
    assert mgr.num_cached_prefix_tokens(PROMPT) == mgr.num_cached_prefix_tokens(PROMPT, cache_salt="other") == 0
    assert [i for i, _ in mgr.import_cached_blocks(PROMPT, 3, 1, cache_salt="tenant")] == [3]  # it extends them
    assert mgr.import_cached_blocks(PROMPT, 3, 1) == []  # an unsalted prompt's block 3 has no prefix here
    mgr.check_integrity()
