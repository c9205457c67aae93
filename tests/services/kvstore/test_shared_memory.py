"""SharedKVPool across real processes, copy_pages and page_checksum."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.dtypes import TORCH_DTYPES
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.page_copy import MAX_RUN_COPIES, block_runs, copy_pages, page_checksum
from services.kvstore.shared_memory import NAME_PREFIX, SharedKVPool
from tests.cuda import needs_cuda

REPO = Path(__file__).resolve().parents[3]
FINGERPRINT = bytes(range(16))


def make_layout(**overrides) -> PageLayout:
    fields = dict(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="bfloat16", num_blocks=10,
                  fingerprint=FINGERPRINT)
    fields.update(overrides)
    return PageLayout(**fields)


def layout_args(layout: PageLayout) -> str:
    return (f"PageLayout({layout.num_layers}, {layout.num_kv_heads}, {layout.block_size}, {layout.head_dim}, "
            f"{layout.dtype!r}, {layout.num_blocks}, {layout.fingerprint!r})")


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)}


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = shm_names()
    yield
    assert shm_names() - before == set()


def writer_code(name: str, layout: PageLayout, src_blocks: list[int], dst_blocks: list[int]) -> str:
    # The prefill side: a local pool whose block b holds the value b + 1 everywhere.
    local = layout.with_num_blocks(8)
    return f"""
        import torch
        from services.kvstore.layout import PageLayout
        from services.kvstore.page_copy import copy_pages, page_checksum
        from services.kvstore.shared_memory import SharedKVPool
        local = torch.arange(1, 9, dtype=torch.float32).view(1, 1, 1, 8, 1, 1)
        local = local.expand({local.shape}).to(torch.{layout.dtype}).contiguous()
        with SharedKVPool.attach({name!r}, {layout_args(local)}) as pool:
            n = copy_pages(local, {src_blocks}, pool.tensor, {dst_blocks})
            print(n, page_checksum(local, {src_blocks}), page_checksum(pool.tensor, {dst_blocks}))
    """


def test_subprocess_writes_exactly_the_given_blocks():
    layout = make_layout()
    src_blocks, dst_blocks = [0, 1, 2, 5], [7, 3, 4, 0]
    with SharedKVPool.create(layout) as pool:
        assert pool.name in shm_names()
        result = run_python(writer_code(pool.name, layout, src_blocks, dst_blocks))
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""  # no resource_tracker warning from the attacher
        num_bytes, src_crc, dst_crc = map(int, result.stdout.split())
        assert num_bytes == 4 * layout.block_nbytes
        assert src_crc == dst_crc == page_checksum(pool.tensor, dst_blocks)
        # The attacher exited first; its tracker must not have unlinked our segment.
        assert pool.name in shm_names()
        t = pool.tensor
        for s, d in zip(src_blocks, dst_blocks):
            assert torch.equal(t[:, :, :, d], torch.full_like(t[:, :, :, d], s + 1))
        untouched = [b for b in range(layout.num_blocks) if b not in dst_blocks]
        assert torch.count_nonzero(t[:, :, :, untouched]) == 0
        del t
    assert pool.name not in shm_names()


@pytest.mark.parametrize(
    "field, override",
    [("head_dim", {"head_dim": 16}), ("fingerprint", {"fingerprint": b"\xff" * 16}), ("dtype", {"dtype": "float16"}),
     ("num_layers", {"num_layers": 3}), ("num_kv_heads", {"num_kv_heads": 1}), ("block_size", {"block_size": 16})],
)
def test_attach_with_wrong_layout_is_refused_naming_the_field(field, override):
    with SharedKVPool.create(make_layout()) as pool:
        with pytest.raises(LayoutMismatchError, match=field):
            SharedKVPool.attach(pool.name, make_layout(**override))


def test_wrong_layout_refused_in_a_subprocess_too():
    with SharedKVPool.create(make_layout()) as pool:
        result = run_python(f"""
            from services.kvstore.layout import PageLayout, LayoutMismatchError
            from services.kvstore.shared_memory import SharedKVPool
            try:
                SharedKVPool.attach({pool.name!r}, {layout_args(make_layout(head_dim=16))})
            except LayoutMismatchError as e:
                print(e)
        """)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert "head_dim" in result.stdout
        assert pool.name in shm_names()


def test_attach_takes_num_blocks_from_the_segment():
    with SharedKVPool.create(make_layout(num_blocks=10)) as pool:
        with SharedKVPool.attach(pool.name, make_layout(num_blocks=3)) as other:
            assert other.num_blocks == 10 and other.tensor.shape == pool.tensor.shape
            assert not other.is_owner


def test_attach_to_a_missing_name_fails_clearly():
    with pytest.raises(FileNotFoundError, match="no shared KV pool segment named 'baton_kv_missing'"):
        SharedKVPool.attach("baton_kv_missing", make_layout())


def test_attach_to_a_foreign_segment_is_refused():
    from multiprocessing import shared_memory

    foreign = shared_memory.SharedMemory(name=NAME_PREFIX + "foreign", create=True, size=8192)
    try:
        with pytest.raises(LayoutMismatchError, match="not a Baton KV pool"):
            SharedKVPool.attach(foreign.name, make_layout())
    finally:
        foreign.close()
        foreign.unlink()


def test_header_and_tensor_alignment():
    layout = make_layout(dtype="float32")
    with SharedKVPool.create(layout) as pool:
        assert pool.tensor.shape == layout.shape and pool.tensor.dtype == torch.float32
        assert pool.tensor.data_ptr() % 4096 == 0
        assert torch.count_nonzero(pool.tensor) == 0
        assert os.path.getsize(f"/dev/shm/{pool.name}") >= 4096 + layout.nbytes


def test_close_refuses_while_a_view_is_alive_and_still_unlinks():
    pool = SharedKVPool.create(make_layout())
    view = pool.tensor[0]
    with pytest.raises(BufferError, match="views are still alive"):
        pool.close()
    assert pool.name not in shm_names()  # unlinked; the mapping stays valid for `view`
    view.fill_(1)
    del view
    pool.close()


def test_only_the_owner_unlinks():
    with SharedKVPool.create(make_layout()) as pool:
        with SharedKVPool.attach(pool.name, make_layout()) as other:
            with pytest.raises(PermissionError):
                other.unlink()
        assert pool.name in shm_names()


def test_owner_closing_first_leaves_the_attacher_mapped():
    pool = SharedKVPool.create(make_layout())
    other = SharedKVPool.attach(pool.name, make_layout())
    pool.close()
    assert pool.name not in shm_names()
    other.tensor.fill_(2)
    other.close()


def test_layout_properties_and_check_compatible():
    layout = make_layout()
    assert layout.shape == (2, 2, 2, 10, 4, 8)
    assert layout.block_nbytes == 2 * 2 * 2 * 4 * 8 * 2
    assert layout.nbytes == 10 * layout.block_nbytes
    assert layout.itemsize == torch.empty((), dtype=TORCH_DTYPES[layout.dtype]).element_size() == 2
    layout.check_compatible(make_layout(num_blocks=99))
    with pytest.raises(LayoutMismatchError, match="fingerprint"):
        layout.check_compatible(make_layout(fingerprint=b"other"))
    # An EAGLE head's layers in one side's pages only: the flag both sides need is named
    with pytest.raises(LayoutMismatchError, match="num_layers.*the same --speculative-config"):
        layout.check_compatible(make_layout(num_layers=3))
    with pytest.raises(ValueError):
        make_layout(dtype="int8")


def test_copy_pages_validates():
    src = torch.zeros(make_layout(num_blocks=4).shape, dtype=torch.bfloat16)
    dst = torch.zeros(make_layout(num_blocks=6).shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        copy_pages(src, [0, 1], dst, [0])
    with pytest.raises(ValueError, match="block id 4 out of range"):
        copy_pages(src, [4], dst, [0])
    with pytest.raises(ValueError, match="block id -1 out of range"):
        copy_pages(src, [0], dst, [-1])
    with pytest.raises(ValueError, match="dtype"):
        copy_pages(src, [0], dst.float(), [0])
    with pytest.raises(ValueError, match="shapes differ"):
        copy_pages(src, [0], torch.zeros(make_layout(head_dim=16).shape, dtype=torch.bfloat16), [0])
    assert copy_pages(src, [], dst, []) == 0


def test_copy_pages_matches_advanced_indexing_for_runs_and_scatter():
    torch.manual_seed(0)
    src = torch.randn(make_layout(num_blocks=12).shape).to(torch.bfloat16)
    dst = torch.zeros(make_layout(num_blocks=20).shape, dtype=torch.bfloat16)
    src_blocks = [0, 1, 2, 3, 9, 5, 6, 11]
    dst_blocks = [10, 11, 12, 2, 19, 0, 1, 7]
    expected = dst.clone()
    expected[:, :, :, dst_blocks] = src[:, :, :, src_blocks]
    assert copy_pages(src, src_blocks, dst, dst_blocks) == 8 * make_layout().block_nbytes
    assert torch.equal(dst, expected)
    assert page_checksum(src, src_blocks) == page_checksum(dst, dst_blocks)
    assert page_checksum(src, src_blocks) != page_checksum(src, src_blocks[::-1])


@pytest.mark.parametrize("src_device, dst_device", [
    ("cpu", "cpu"), *(pytest.param(*pair, id="-".join(pair) + "-cuda", marks=needs_cuda)
                      for pair in [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])])
@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
def test_copy_pages_between_devices_in_runs_and_scattered(src_device, dst_device, scattered):
    """A few runs are copied run by run; more than MAX_RUN_COPIES of them by index on a GPU."""
    torch.manual_seed(1)
    num_blocks = 2 * MAX_RUN_COPIES + 8
    src = torch.randn(make_layout(num_blocks=num_blocks).shape).to(torch.bfloat16).to(src_device)
    dst = torch.zeros(make_layout(num_blocks=num_blocks + 6).shape, dtype=torch.bfloat16, device=dst_device)
    src_blocks = list(range(num_blocks))
    dst_blocks = list(range(num_blocks + 6))[::-1][:num_blocks] if scattered else list(range(3, num_blocks + 3))
    assert len(block_runs(src_blocks, dst_blocks)) == (num_blocks if scattered else 1)
    expected = dst.cpu().clone()
    expected[:, :, :, dst_blocks] = src.cpu()[:, :, :, src_blocks]
    assert copy_pages(src, src_blocks, dst, dst_blocks) == num_blocks * make_layout().block_nbytes
    assert torch.equal(dst.cpu(), expected)


def test_throughput_copy_pages_into_shm_vs_plain_copy(capsys):
    """Not an assertion: ~256 MiB of 1 MiB blocks, printed for the report (-s to see it)."""
    layout = PageLayout(16, 8, 16, 128, "bfloat16", 320, FINGERPRINT)  # 1 MiB per block
    num_blocks = 256
    src = torch.ones(layout.with_num_blocks(num_blocks).shape, dtype=torch.bfloat16)
    plain_src = torch.ones(num_blocks * layout.block_nbytes // 2, dtype=torch.bfloat16)
    plain_dst = torch.empty_like(plain_src)
    dst_runs = list(range(32, 32 + num_blocks))
    dst_scattered = list(range(64, 64 + num_blocks))[::-1]

    def best_gbps(fn) -> float:
        fn()  # first touch of the shm pages is not what we measure
        best = min(_timed(fn) for _ in range(3))
        return num_blocks * layout.block_nbytes / best / 1e9

    with SharedKVPool.create(layout) as pool:
        runs = best_gbps(lambda: copy_pages(src, list(range(num_blocks)), pool.tensor, dst_runs))
        scattered = best_gbps(lambda: copy_pages(src, list(range(num_blocks)), pool.tensor, dst_scattered))
    plain = best_gbps(lambda: plain_dst.copy_(plain_src))
    with capsys.disabled():
        print(f"\n[kvstore] 256 MiB: copy_pages into shm {runs:.2f} GB/s (one run), {scattered:.2f} GB/s "
              f"(every block its own run); plain torch copy_ {plain:.2f} GB/s; ratio {runs / plain:.2f} / "
              f"{scattered / plain:.2f}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_block_runs_of_long_lists_are_those_of_the_loop():
    """Long block lists are split into runs with numpy; the runs are the plain loop's."""
    import random

    def by_loop(src, dst):
        runs = []
        for s, d in zip(src, dst):
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((s, d, 1))
        return runs

    rng = random.Random(3)
    for n in (0, 1, 63, 64, 65, 200, 3000):
        src = sorted(rng.sample(range(4 * n + 8), n))  # runs and gaps
        dst = list(range(10, 10 + n)) if n % 2 else sorted(rng.sample(range(3 * n + 8), n))
        assert block_runs(src, dst) == by_loop(src, dst), n
        assert block_runs(range(n), range(5, 5 + n)) == ([(0, 5, n)] if n else [])


def test_a_gone_decode_pools_segment_is_unmapped_once_the_next_is_attached():
    """A prefill worker's mapping of a decode worker's pool keeps the pool's memory alive, unlinked or
    not: once the decode worker is gone (its segment's name with it), attaching the next segment unmaps it."""
    import asyncio

    from services.kvstore.shm_transport import SharedMemoryTransport
    from services.kvstore.transport import KVDestination

    def mapped(name: str) -> bool:
        return name in Path("/proc/self/maps").read_text()

    layout = make_layout(num_blocks=8)
    transport = SharedMemoryTransport(layout)
    src = torch.randn(layout.shape).to(torch.bfloat16)
    first = SharedKVPool.create(layout)
    first.fence.grant("00000000000000aa", [3, 4])  # as the decode worker reserves them
    asyncio.run(transport.write("r", src, [0, 1], KVDestination("00000000000000aa", (3, 4), shm_name=first.name),
                                [3, 4]))
    first.close()  # its owner unlinks it and goes: a decode worker that stopped
    assert mapped(first.name)  # the prefill side's mapping holds its memory still
    with SharedKVPool.create(layout) as second:
        second.fence.grant("00000000000000bb", [5, 6])
        asyncio.run(transport.write("s", src, [0, 1], KVDestination("00000000000000bb", (5, 6),
                                                                    shm_name=second.name), [5, 6]))
        assert not mapped(first.name) and mapped(second.name)
        assert torch.equal(second.tensor[:, :, :, [5, 6]], src[:, :, :, [0, 1]])
        asyncio.run(transport.close())
