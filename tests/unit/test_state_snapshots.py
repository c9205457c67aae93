"""`StateSnapshots`: a hybrid model's recurrent states kept by prefix, least recently used out first, in a budget."""
from __future__ import annotations

import torch

from engine.state_snapshots import StateSnapshots


def test_the_least_recently_used_states_go_first_to_keep_within_the_budget():
    kept = StateSnapshots(max_bytes=3 * 40)  # three rows of 10 floats
    for h in (1, 2, 3):
        kept.put(h, torch.full((10,), float(h)))
    assert kept.get(1)[0] == 1.0  # now the most recently used
    kept.put(4, torch.zeros(10))
    assert 2 not in kept and all(h in kept for h in (1, 3, 4)) and kept.num_bytes == 120
    kept.put(5, torch.zeros(31))  # over the budget alone: not kept, nothing dropped for it
    assert len(kept) == 3 and 5 not in kept


def test_a_kept_row_is_a_copy_in_host_memory():
    kept = StateSnapshots(max_bytes=1000)
    rows = torch.ones(4)
    kept.put(7, rows)
    rows.zero_()  # the sequence's states go on changing
    assert kept.get(7).tolist() == [1.0] * 4 and kept.get(8) is None
    kept.clear()
    assert len(kept) == 0 and kept.num_bytes == 0
