"""The prefix cache's ordered KV events (vLLM's, for Dynamo's and llm-d's routers): a subscriber
that applies them in order holds exactly what the cache holds, each block under the hash chained
from its parent and its tokens; a subscriber starting late is told what is cached first."""
from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import rule

from engine.block_hash import block_hash, hash_block_chain
from engine.block_manager import BlockManager
from engine.kv_event_log import AllBlocksCleared, RemovedBlocks, StoredBlocks
from tests.unit.test_block_manager import BS, BlockManagerMachine, admitted, make_seq


class Subscriber:
    """A router's copy of one worker's cache, fed only by its events."""

    def __init__(self, extra: bytes = b"") -> None:
        self.extra = extra
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> (parent, tokens)

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, RemovedBlocks):
                for h in event.block_hashes:
                    assert self.blocks.pop(h, None) is not None, f"{h:#x} removed, never stored"
            else:
                assert len(event.token_ids) == BS * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * BS : (i + 1) * BS])
                    assert h == block_hash(parent, tokens, self.extra), "a hash not chained from its parent"
                    assert h not in self.blocks, f"{h:#x} stored twice"
                    self.blocks[h] = (parent, tokens)
                    parent = h

    def matches(self, mgr: BlockManager) -> bool:
        cached = {b.hash: (b.parent_hash, b.token_ids) for b in mgr.blocks if b.hash is not None}
        return self.blocks == cached


def test_a_prompts_new_blocks_are_one_event_and_evictions_one_more():
    mgr = BlockManager(6, BS)
    assert mgr.take_kv_events() == []  # nothing recorded until enabled
    assert mgr.enable_kv_events() == [AllBlocksCleared()]
    a = admitted(mgr, "a", range(9), computed=True)
    h0, h1 = hash_block_chain(list(range(9)), BS)
    assert mgr.take_kv_events() == [StoredBlocks([h0, h1], None, list(range(8)), None)]
    b = admitted(mgr, "b", [*range(8), 50, 51, 52, 53, 54], computed=True)  # shares both, adds one
    (h2,) = hash_block_chain([50, 51, 52, 53], BS, parent_hash=h1)
    assert mgr.take_kv_events() == [StoredBlocks([h2], h1, [50, 51, 52, 53], None)]
    mgr.free(a)
    mgr.free(b)
    admitted(mgr, "c", [100] * (6 * BS - 1))  # six fresh pages: every cached block goes
    (removed,) = mgr.take_kv_events()
    assert isinstance(removed, RemovedBlocks) and sorted(removed.block_hashes) == sorted([h0, h1, h2])
    assert mgr.take_kv_events() == []


def test_a_reset_is_all_cleared_and_a_late_subscriber_hears_what_is_cached():
    mgr = BlockManager(8, BS)
    admitted(mgr, "a", range(9), computed=True)
    admitted(mgr, "b", [7] * 9, computed=True)
    late = Subscriber()
    late.apply(mgr.enable_kv_events())
    assert late.matches(mgr) and len(late.blocks) == 4
    for seq_id in ("a", "b"):
        mgr.free(mgr._seqs[seq_id])
    mgr.take_kv_events()
    assert mgr.reset_prefix_cache() == 4
    assert mgr.take_kv_events() == [AllBlocksCleared()]


def test_imported_and_adopted_blocks_are_stored_under_their_parents():
    mgr = BlockManager(8, BS)
    subscriber = Subscriber()
    subscriber.apply(mgr.enable_kv_events())
    tokens = list(range(20))
    admitted(mgr, "a", tokens[:9], computed=True)  # blocks 0 and 1
    assert mgr.import_cached_blocks(tokens, 2, 2)  # 2 and 3, read from a kvstore node
    mgr.reserve("r", 2)
    seq = make_seq("r", [9] * 8)
    seq.num_computed_tokens = 8
    mgr.adopt("r", seq)  # a prompt prefill handed over
    subscriber.apply(mgr.take_kv_events())
    assert subscriber.matches(mgr) and len(subscriber.blocks) == 6


class KVEventsMachine(BlockManagerMachine):
    """The block manager machine with a subscriber fed by its events after every operation."""

    def __init__(self) -> None:
        super().__init__()
        self.subscriber = Subscriber(b"fp")
        self.subscriber.apply(self.mgr.enable_kv_events())

    @rule()
    def reset(self):
        self.mgr.reset_prefix_cache()

    @rule()
    def take(self):
        self.subscriber.apply(self.mgr.take_kv_events())
        assert self.subscriber.matches(self.mgr)


TestKVEventsStateful = KVEventsMachine.TestCase
TestKVEventsStateful.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
