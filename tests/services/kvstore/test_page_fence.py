"""The fence over a shared-memory pool's pages (page_fence.py), between this process as the decode worker
and a real writer process: a copy holds its pages against their reservation's end, and a copy after the
end (or for a reservation never made) writes nothing."""
from __future__ import annotations

import signal

import pytest
import torch

from services.kvstore.page_fence import ReservationEndedError, runs, token_of
from services.kvstore.shared_memory import SharedKVPool
from services.kvstore.shm_transport import SharedMemoryTransport
from services.kvstore.transport import KVDestination
from tests.services.kvstore.test_shared_memory import layout_args, make_layout, no_leftover_segments  # noqa: F401
from tests.services.service_process import REPO_ROOT

RESERVATION = "0123456789abcdef"


def test_runs_are_the_ids_consecutive_runs():
    assert runs([7, 3, 1, 2, 3, 9]) == [(1, 3), (7, 1), (9, 1)]
    assert runs([]) == []


def test_only_a_decode_workers_reservation_id_has_a_token():
    assert token_of(RESERVATION) == 0x0123456789ABCDEF
    assert [token_of(bad) for bad in ("", "r", "0123456789abcde", "0123456789abcdefab", "0123456789abcdeg")] == [0] * 5


def write(pool: SharedKVPool, reservation_id: str, block_ids: list[int], value: float) -> None:
    """What a prefill process does: `value` into `block_ids` by the shared-memory transport."""
    import asyncio

    transport = SharedMemoryTransport(pool.layout)
    pages = torch.full(pool.layout.shape, value, dtype=pool.tensor.dtype)
    dest = KVDestination(reservation_id, tuple(block_ids), shm_name=pool.name)
    try:
        transport.open(dest)
        asyncio.run(transport.write("r", pages, range(len(block_ids)), dest, block_ids))
    finally:
        asyncio.run(transport.close())


def test_a_copy_is_refused_unless_its_reservation_holds_its_pages():
    with SharedKVPool.create(make_layout(dtype="float32")) as pool:
        pool.fence.grant(RESERVATION, [2, 3])
        write(pool, RESERVATION, [2, 3], 1.0)
        with pytest.raises(ReservationEndedError):  # not all of them its reservation's
            write(pool, RESERVATION, [3, 4], 2.0)
        with pytest.raises(ReservationEndedError):  # no reservation's id
            write(pool, "not-a-reservation", [0], 2.0)
        high = "fedcba9876543210"  # over 2**63: compared as the uint64 it is, not as a float
        pool.fence.grant(high, [1])
        write(pool, high, [1], 3.0)
        with pytest.raises(ReservationEndedError):
            write(pool, "fedcba9876543211", [1], 2.0)
        pool.fence.revoke([2, 3])
        assert pool.fence.is_unwritten([2, 3])
        with pytest.raises(ReservationEndedError):
            write(pool, RESERVATION, [2, 3], 2.0)
        assert pool.tensor[:, :, :, [2, 3]].eq(1.0).all() and pool.tensor[:, :, :, 1].eq(3.0).all()
        assert pool.tensor[:, :, :, [0, 4]].eq(0).all()


def test_pages_a_writer_process_holds_are_not_free_until_it_lets_go_or_dies():
    import subprocess
    import sys

    layout = make_layout(dtype="float32")
    with SharedKVPool.create(layout) as pool:
        pool.fence.grant(RESERVATION, [4, 5, 6])
        writer = subprocess.Popen([sys.executable, "-c", f"""
import sys
from services.kvstore.layout import PageLayout
from services.kvstore.shared_memory import SharedKVPool
with SharedKVPool.attach({pool.name!r}, {layout_args(layout)}) as pool:
    with pool.fence.writing({RESERVATION!r}, [5, 6]):
        print("holding", flush=True)
        sys.stdin.readline()
    print("let go", flush=True)
    sys.stdin.readline()
"""], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout.readline() == "holding\n"
            pool.fence.revoke([4, 5, 6])
            assert not pool.fence.is_unwritten([4, 5, 6])  # ended mid-copy: not to be freed yet
            assert pool.fence.is_unwritten([4]) and not pool.fence.is_unwritten([6])
            writer.stdin.write("\n")
            writer.stdin.flush()
            assert writer.stdout.readline() == "let go\n"
            assert pool.fence.is_unwritten([4, 5, 6])  # the writer, still alive, has let go
            writer.stdin.write("\n")
            writer.stdin.flush()
            assert writer.wait(timeout=30) == 0
        finally:
            writer.kill()
            writer.wait()

        pool.fence.grant(RESERVATION, [4, 5, 6])
        dying = subprocess.Popen([sys.executable, "-c", f"""
import time
from services.kvstore.layout import PageLayout
from services.kvstore.shared_memory import SharedKVPool
pool = SharedKVPool.attach({pool.name!r}, {layout_args(layout)})
with pool.fence.writing({RESERVATION!r}, [4, 5, 6]):
    print("holding", flush=True)
    time.sleep(60)
"""], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert dying.stdout.readline() == "holding\n"
            pool.fence.revoke([4, 5, 6])
            assert not pool.fence.is_unwritten([4, 5, 6])
        finally:
            dying.send_signal(signal.SIGKILL)  # a prefill worker that died mid-copy holds nothing
            dying.wait()
        assert pool.fence.is_unwritten([4, 5, 6])
