"""KV block residency (vLLM's --kv-cache-metrics): a sampled prefix-cache block's lifetime, idle
time before eviction and reuse gaps, exactly, on a clock the test moves; only evictions count."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.kv_block_residency import KVBlockResidency
from tests.unit.test_block_manager import BS, admitted


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def followed(num_blocks: int, sample_rate: float = 1.0, draws=None) -> tuple[BlockManager, Clock]:
    mgr, clock = BlockManager(num_blocks, BS), Clock()
    draw = (lambda: 0.0) if draws is None else iter(draws).__next__
    mgr.prefix_cache.residency = KVBlockResidency(sample_rate, clock=clock, draw=draw)
    return mgr, clock


def bucket(counts, bound: float) -> int:
    return dict(counts.cumulative_buckets())[bound]


def test_lifetime_idle_time_and_reuse_gaps_of_an_evicted_block():
    mgr, clock = followed(4)
    mgr.free(admitted(mgr, "a", range(9), computed=True))  # two blocks cached at 100
    clock.now = 102
    mgr.free(admitted(mgr, "b", range(9)))  # both read: used at 102
    clock.now = 105
    mgr.free(admitted(mgr, "c", range(9)))  # again at 105
    clock.now = 109
    residency = mgr.prefix_cache.residency
    assert residency.lifetime.counts == [0] * len(residency.lifetime.counts)  # nothing evicted yet
    admitted(mgr, "d", [500] * (4 * BS - 1))  # four fresh pages: both cached blocks go
    assert (residency.lifetime.total, residency.idle_before_evict.total) == (2 * 9, 2 * 4)
    assert bucket(residency.lifetime, 10) - bucket(residency.lifetime, 5) == 2
    assert bucket(residency.idle_before_evict, 5) - bucket(residency.idle_before_evict, 2) == 2
    # Caching, then two uses: gaps of 2 and 3 for each block.
    assert residency.reuse_gap.total == 2 * (2 + 3) and bucket(residency.reuse_gap, float("inf")) == 4


def test_only_the_last_four_gaps_are_counted_and_a_never_used_block_idles_its_whole_life():
    mgr, clock = followed(3)
    mgr.free(admitted(mgr, "a", range(5), computed=True))  # one block, cached at 100
    for i in range(6):  # used at 101 .. 106
        clock.now += 1
        mgr.free(admitted(mgr, f"r{i}", range(5)))
    mgr.free(admitted(mgr, "lone", [7] * 5, computed=True))  # cached at 106, never used
    clock.now = 110
    admitted(mgr, "d", [500] * (3 * BS - 1))  # every page: both go
    residency = mgr.prefix_cache.residency
    assert residency.lifetime.total == 10 + 4
    assert residency.idle_before_evict.total == 4 + 4  # the used one last used at 106, the lone one cached then
    assert bucket(residency.reuse_gap, float("inf")) == 4 and residency.reuse_gap.total == 4


def test_a_reset_counts_nothing_and_only_sampled_blocks_count():
    mgr, clock = followed(4)
    mgr.free(admitted(mgr, "a", range(9), computed=True))
    assert mgr.reset_prefix_cache() == 2
    admitted(mgr, "d", [500] * (4 * BS - 1))
    assert bucket(mgr.prefix_cache.residency.lifetime, float("inf")) == 0

    mgr, clock = followed(4, sample_rate=0.5, draws=[0.7, 0.2])  # the first block not sampled, the second is
    mgr.free(admitted(mgr, "a", range(9), computed=True))
    admitted(mgr, "d", [500] * (4 * BS - 1))
    assert bucket(mgr.prefix_cache.residency.lifetime, float("inf")) == 1


@pytest.mark.parametrize("rate", [0, -0.1, 1.5])
def test_a_sample_rate_outside_0_to_1_is_refused(rate):
    with pytest.raises(ValueError, match="sample rate must be in"):
        KVBlockResidency(rate)
