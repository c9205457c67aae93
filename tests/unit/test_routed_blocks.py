"""The router's memory of which blocks it sent where: counts per worker, a block counted once
(for the worker it went to last), forgotten after the window or past the cap."""
from __future__ import annotations

import time

from services.gateway.routed_blocks import RoutedBlocks


def test_counts_follow_the_last_worker_each_block_went_to():
    routed = RoutedBlocks(window_s=60)
    routed.add("a", [1, 2, 3])
    routed.add("b", [3, 4])
    routed.add("a", [1, 2])  # again: counted once
    assert (routed.count("a"), routed.count("b"), routed.count("c")) == (2, 2, 0)


def test_blocks_are_forgotten_after_the_window_and_past_the_cap():
    routed = RoutedBlocks(window_s=0.05)
    routed.add("a", [1, 2])
    time.sleep(0.06)
    routed.add("b", [3])
    assert (routed.count("a"), routed.count("b")) == (0, 1)
    capped = RoutedBlocks(window_s=60, max_blocks=3)
    capped.add("a", [1, 2, 3])
    capped.add("b", [4, 5])
    assert (capped.count("a"), capped.count("b")) == (1, 2)  # the least recently routed went first


def test_leading_counts_the_run_each_worker_was_sent_lately():
    routed = RoutedBlocks(window_s=60)
    routed.add("a", [1, 2, 3])
    routed.add("b", [3])  # block 3 went elsewhere last: a's run stops at 2
    assert routed.leading([1, 2, 3, 4], within_s=2) == {"a": 2}
    time.sleep(0.06)
    assert routed.leading([1, 2], within_s=0.05) == {}
