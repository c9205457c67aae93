"""A GPU pool's page fence in a segment of its own (fence_segment.py), between this process as the decode
worker and a real writer process as a prefill worker copying by CUDA IPC would hold it: the pages' tokens
and locks behave as a shared-memory pool's do, and the segment is checked, found and removed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory

import pytest

from services.kvstore.fence_segment import FENCE_PREFIX, FenceSegment
from services.kvstore.layout import LayoutMismatchError
from services.kvstore.page_fence import ReservationEndedError
from tests.services.kvstore.test_shared_memory import no_leftover_segments  # noqa: F401
from tests.services.service_process import REPO_ROOT

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

RESERVATION = "0123456789abcdef"
NUM_BLOCKS = 12


def writer(name: str, script: str) -> subprocess.Popen:
    """A process that attaches fence `name` as `fence` and runs `script`."""
    return subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from services.kvstore.fence_segment import FenceSegment
fence = FenceSegment.attach({name!r}, {NUM_BLOCKS}).fence
{script}
"""], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_writer_process_writes_only_under_a_live_reservation_and_holds_its_pages_until_it_lets_go_or_dies():
    owner = FenceSegment.create(NUM_BLOCKS)
    try:
        owner.fence.grant(RESERVATION, [4, 5, 6])
        holding = writer(owner.name, f"""
with fence.writing({RESERVATION!r}, [5, 6]):
    print("holding", flush=True)
    sys.stdin.readline()
print("let go", flush=True)
try:
    with fence.writing({RESERVATION!r}, [5, 6]):
        print("wrote after the end", flush=True)
except ValueError as e:
    print(type(e).__name__, flush=True)
""")
        try:
            assert holding.stdout.readline() == "holding\n"
            owner.fence.revoke([4, 5, 6])
            assert not owner.fence.is_unwritten([4, 5, 6]) and owner.fence.is_unwritten([4])
            holding.stdin.write("\n")
            holding.stdin.flush()
            assert holding.stdout.readline() == "let go\n"
            assert holding.stdout.readline() == f"{ReservationEndedError.__name__}\n"
            assert holding.wait(timeout=30) == 0
            assert owner.fence.is_unwritten([4, 5, 6])
        finally:
            holding.kill()
            holding.wait()

        owner.fence.grant(RESERVATION, [7])
        dying = writer(owner.name, f"""
with fence.writing({RESERVATION!r}, [7]):
    print("holding", flush=True)
    time.sleep(60)
""")
        try:
            assert dying.stdout.readline() == "holding\n"
            owner.fence.revoke([7])
            assert not owner.fence.is_unwritten([7])
        finally:
            dying.send_signal(signal.SIGKILL)
            dying.wait()
        assert owner.fence.is_unwritten([7])
    finally:
        owner.close()
    assert not os.path.exists(f"/dev/shm/{owner.name}")


def test_only_the_fence_of_a_pool_of_that_many_pages_is_attached():
    owner = FenceSegment.create(NUM_BLOCKS)
    foreign = shared_memory.SharedMemory(name=FENCE_PREFIX + "foreign", create=True, size=4096)
    try:
        attached = FenceSegment.attach(owner.name, NUM_BLOCKS)
        attached.close()
        assert os.path.exists(f"/dev/shm/{owner.name}")  # an attacher never unlinks
        with pytest.raises(LayoutMismatchError, match=f"pool of {NUM_BLOCKS + 1} pages"):
            FenceSegment.attach(owner.name, NUM_BLOCKS + 1)
        with pytest.raises(LayoutMismatchError, match="not the page fence"):
            FenceSegment.attach(foreign.name, NUM_BLOCKS)
        with pytest.raises(LayoutMismatchError, match="does not name a KV page fence"):
            FenceSegment.attach("baton_kv_0123456789abcdef", NUM_BLOCKS)
        with pytest.raises(FileNotFoundError):
            FenceSegment.attach(FENCE_PREFIX + "missing", NUM_BLOCKS)
    finally:
        foreign.close()
        foreign.unlink()
        owner.close()
