"""The CUDA_IPC transport: without CUDA it imports and refuses cleanly; with CUDA, pages
written through another process's exported pool land byte-exact in its blocks, and only while
their reservation holds them (the pool's fence segment)."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os

import pytest
import torch

from services.kvstore.cuda_ipc import CudaIpcTransport, export_handle, open_handle
from services.kvstore.cuda_pool import CudaKVPool
from services.kvstore.layout import PageLayout
from services.kvstore.page_fence import ReservationEndedError
from services.kvstore.transport import DestinationError, KVDestination, TransportKind, choose_transport
from tests.cuda import needs_cuda

LAYOUT = PageLayout(2, 2, 16, 16, "float16", 32, b"\x05" * 32)


RESERVATION = "0123456789abcdef"


def _dest(**fields) -> KVDestination:
    return KVDestination(reservation_id=RESERVATION, block_ids=(4, 5, 9), **fields)


def test_chosen_only_between_two_cuda_pools_on_one_host():
    dest = _dest(cuda_ipc_handle=b"{}", shm_name="seg", address="h:1", host_id="A",
                 offered=frozenset(TransportKind))
    assert choose_transport(dest, own_host_id="A", is_cuda_pool=True) is TransportKind.CUDA_IPC
    assert choose_transport(dest, own_host_id="A", is_cuda_pool=False) is TransportKind.SHARED_MEMORY
    assert choose_transport(dest, own_host_id="B", is_cuda_pool=True) is TransportKind.GRPC_STREAM


def test_refused_cleanly_without_a_usable_handle():
    with pytest.raises(ValueError, match="CUDA tensor"):
        export_handle(torch.zeros(LAYOUT.shape, dtype=torch.float16), "baton_kv_fence_0123456789abcdef")
    with pytest.raises(ValueError, match="not a CUDA IPC pool handle"):
        open_handle(b"not json", LAYOUT)
    with pytest.raises(ValueError, match="not a CUDA IPC pool handle"):
        open_handle(b'{"format": "something else"}', LAYOUT)
    with pytest.raises(ValueError, match="not a CUDA IPC pool handle"):  # one without its pages' fence
        open_handle(b'{"format": "baton-cuda-ipc/1"}', LAYOUT)
    transport = CudaIpcTransport(LAYOUT)
    with pytest.raises(DestinationError, match="cuda_ipc_handle"):
        transport.open(_dest())
    if not torch.cuda.is_available():
        with pytest.raises(DestinationError, match="needs CUDA"):
            transport.open(_dest(cuda_ipc_handle=b"{}"))


def _owner(handles: mp.Queue, results: mp.Queue, revoke: mp.Event, revoked: mp.Event, done: mp.Event) -> None:
    """A decode worker's pool: blocks 4, 5 and 9 reserved, until `revoke`."""
    pool = CudaKVPool(LAYOUT, "cuda")
    pool.fence.grant(RESERVATION, [4, 5, 9])
    handles.put(pool.ipc_handle)
    revoke.wait(60)
    pool.fence.revoke([4, 5, 9])
    revoked.set()
    done.wait(60)
    results.put(pool.tensor.cpu().numpy())  # by value: a shared tensor's memory would leave with this process
    pool.close()


@needs_cuda
def test_pages_land_in_the_other_process_pool_only_while_reserved():
    ctx = mp.get_context("spawn")
    handles, results, revoke, revoked, done = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(handles, results, revoke, revoked, done))
    owner.start()
    try:
        handle = handles.get(timeout=60)
        src = torch.randn(LAYOUT.shape, device="cuda").to(torch.float16)
        transport = CudaIpcTransport(LAYOUT)
        dest = _dest(cuda_ipc_handle=handle)
        transport.open(dest)
        num_bytes = asyncio.run(transport.write("r", src, [1, 2, 3], dest, list(dest.block_ids)))
        assert num_bytes == 3 * LAYOUT.block_nbytes
        revoke.set()  # the reservation ends (aborted, or its lease ran out): a late copy writes nothing
        assert revoked.wait(60)
        with pytest.raises(ReservationEndedError):
            asyncio.run(transport.write("r", torch.ones_like(src), [1, 2, 3], dest, list(dest.block_ids)))
        asyncio.run(transport.close())
        done.set()
        written = torch.from_numpy(results.get(timeout=60))
        expected = torch.zeros(LAYOUT.shape, dtype=torch.float16)
        expected[:, :, :, [4, 5, 9]] = src[:, :, :, [1, 2, 3]].cpu()
        assert torch.equal(written, expected)
    finally:
        done.set()
        owner.join(60)
    assert owner.exitcode == 0
    assert not os.path.exists(f"/dev/shm/{json.loads(handle)['fence']}")  # the pool's close unlinked its fence
