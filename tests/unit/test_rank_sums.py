"""RankGroup's sums across ranks in processes of their own (engine/tensor_parallel.py): through shared
memory for tensors that fit its slots, gloo's for larger ones, the same bits on every rank, and a rank
that goes away noticed instead of waited for."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import shared_memory_sum
from engine.tensor_parallel import RankGroup, listening_store
from tests.services.preloaded_python import ForkedProcess, spawn

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = (8, 64)  # a decode step's hidden states
LARGE = (shared_memory_sum.SLOT_BYTES // 4 // 64 + 1, 64)  # a float32 tensor one row past a slot


def rank_values(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank)) * 1e3


# Another rank: joins, sums its values of each shape twice (the slots' two sets and back), prints the results' bits.
RANK = """
import hashlib, sys, torch
from engine.tensor_parallel import RankGroup
from tests.unit.test_rank_sums import SMALL, LARGE, rank_values
rank, size, port, calls = map(int, sys.argv[1:])
group = RankGroup(rank, size, port)
for _ in range(calls):
    for shape in (SMALL, LARGE):
        print(hashlib.sha256(group.all_reduce(rank_values(rank, shape)).numpy().tobytes()).hexdigest(), flush=True)
group.close()
"""


def start_ranks(size: int, calls: int) -> tuple[dict, list[ForkedProcess | subprocess.Popen]]:
    store = listening_store(size)
    # Forked from the tests' preloaded Python: a fresh one spends two seconds of CPU importing torch.
    others = [spawn([sys.executable, "-c", RANK, str(rank), str(size), str(store.port), str(calls)])
              for rank in range(1, size)]
    return store, others


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_holds_the_same_sum_small_and_large(size):
    store, others = start_ranks(size, calls=2)
    group = RankGroup(0, size, store.port, store)
    ours = []
    for _ in range(2):
        for shape in (SMALL, LARGE):
            total = group.all_reduce(rank_values(0, shape))
            expected = sum(rank_values(rank, shape) for rank in range(size))
            torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-3)
            ours.append(hashlib.sha256(total.numpy().tobytes()).hexdigest())
    group.close()
    for other in others:
        out = other.stdout.read()
        assert other.wait(timeout=60) == 0
        if shared_memory_sum.is_supported():  # gloo's ring may leave ranks a rounding apart; ours sum alike
            assert out.split()[0::2] == ours[0::2]


@pytest.mark.skipif(not shared_memory_sum.is_supported(), reason="sums go by gloo on this CPU")
def test_a_rank_that_exits_is_noticed_by_those_waiting_on_its_sum():
    store, others = start_ranks(2, calls=0)  # joins, then exits without summing

    def check_peers():
        if others[0].poll() is not None:
            raise RuntimeError("rank 1 exited")

    group = RankGroup(0, 2, store.port, store, check_peers=check_peers)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        group.all_reduce(rank_values(0, SMALL))
    assert time.monotonic() - start < 5
