"""A kvstore node (`python -m services.kvstore`) as a real process: blocks written by
hash read back byte-exact as the longest stored prefix, least recently used blocks
evicted under the capacity (to a disk tier, with --disk-dir, and read back from it), and a
layout that is not the stored one refused."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from engine.dtypes import TORCH_DTYPES
from protos import kvstore_pb2, kvstore_pb2_grpc
from services.common.converters import layout_to_proto
from services.kvstore.converters import chunk_from_proto, chunk_to_proto
from services.kvstore.grpc_stream import GrpcStreamSender
from services.kvstore.layout import PageLayout
from services.kvstore.page_chunks import layer_block_nbytes, plan_chunks, scatter_chunk
from services.kvstore.servicer import SERVICE_NAME
from tests.services.service_process import REPO_ROOT, ServiceProcess

# One layer of one block is 32 KiB (f32), a block 128 KiB; the sender's chunks hold 3 layer-blocks.
LAYOUT = PageLayout(num_layers=4, num_kv_heads=4, block_size=16, head_dim=64, dtype="float32", num_blocks=24,
                    fingerprint=b"\x07" * 32)
BLOCK_NBYTES = LAYOUT.block_nbytes  # 256 KiB
CAPACITY_BLOCKS = 10


class KVStoreProcess(ServiceProcess):
    """ServiceProcess without --model: a kvstore node loads none (serving at once)."""

    def __init__(self, *extra_args: str):
        super().__init__("kvstore", SERVICE_NAME, None, *extra_args)


@pytest.fixture(scope="module")
def node():
    svc = KVStoreProcess("--capacity-bytes", str(CAPACITY_BLOCKS * BLOCK_NBYTES))
    svc.stub = kvstore_pb2_grpc.KVStoreStub(svc.channel)
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def pool():
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(3))


def _store(node, pool, blocks: list[int], hashes: list[int]) -> int:
    async def send() -> int:
        sender = GrpcStreamSender(LAYOUT, max_chunk_bytes=3 * layer_block_nbytes(LAYOUT))
        try:
            return await sender.write(node.address, pool, blocks, request_id="w", block_hashes=hashes)
        finally:
            await sender.close()

    return asyncio.run(send())


def _read(node, hashes: list[int], layout: PageLayout = LAYOUT, layer_start: int = 0, layer_end: int = 0
          ) -> tuple[list[int], torch.Tensor]:
    """The hashes the node returned, and their pages as a pool `[L, 2, Hkv, len, bs, D]`."""
    chunks = list(node.stub.ReadPages(kvstore_pb2.PageQuery(
        request_id="r", layout=layout_to_proto(layout), block_hashes=hashes, layer_start=layer_start,
        layer_end=layer_end), timeout=10))
    returned = list(dict.fromkeys(h for c in chunks for h in c.block_hashes))
    out = torch.zeros(layout.with_num_blocks(max(len(returned), 1)).shape, dtype=TORCH_DTYPES[layout.dtype])
    position = {h: i for i, h in enumerate(returned)}
    for chunk in chunks:
        assert len(chunk.data) <= 2 * 1024 * 1024 and chunk.HasField("checksum")
        received = chunk_from_proto(chunk, layout)
        scatter_chunk(out, [position[h] for h in received.block_hashes], received.layer_start, received.pages)
    return returned, out


def test_store_and_read_back_the_longest_prefix(node, pool):
    blocks, hashes = [3, 9, 4, 20], [101, 102, 103, 104]
    assert _store(node, pool, blocks, hashes) == 4 * BLOCK_NBYTES
    returned, pages = _read(node, hashes)
    assert returned == hashes
    assert torch.equal(pages, pool[:, :, :, blocks])
    # Stops at the first block it does not hold, even when later ones are held.
    returned, pages = _read(node, [101, 102, 999, 104])
    assert returned == [101, 102] and torch.equal(pages, pool[:, :, :, [3, 9]])
    assert _read(node, [999, 101])[0] == []
    # A layer range: only those layers come back.
    chunks = list(node.stub.ReadPages(kvstore_pb2.PageQuery(
        layout=layout_to_proto(LAYOUT), block_hashes=hashes, layer_start=1, layer_end=3), timeout=10))
    assert {(c.layer_start, c.layer_end) for c in chunks} <= {(1, 2), (2, 3), (1, 3)}
    assert sum(len(c.data) for c in chunks) == 2 * 4 * layer_block_nbytes(LAYOUT)


def test_least_recently_used_blocks_are_evicted(node, pool):
    _store(node, pool, list(range(CAPACITY_BLOCKS)), [200 + i for i in range(CAPACITY_BLOCKS)])
    assert _read(node, [200])[0] == [200]  # 200 is now the most recently used
    _store(node, pool, [20, 21], [300, 301])  # two blocks over the capacity: the two least recent go
    assert _read(node, [201])[0] == [] and _read(node, [202])[0] == []
    returned, pages = _read(node, [200, 203, 209, 300, 301])
    assert returned == [200, 203, 209, 300, 301]
    assert torch.equal(pages, pool[:, :, :, [0, 3, 9, 20, 21]])
    with pytest.raises(grpc.RpcError) as e:  # a stream over the whole capacity is refused, nothing stored
        _store(node, pool, list(range(CAPACITY_BLOCKS + 1)), [400 + i for i in range(CAPACITY_BLOCKS + 1)])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _read(node, [300])[0] == [300]


def test_a_stream_refused_midway_reaches_the_client_with_its_status(node, pool):
    """The node refuses a stream over its capacity after its first chunks, while the client still sends:
    the client must get RESOURCE_EXHAUSTED, not grpcio's INTERNAL for a write that failed as the call
    ended (grpc/grpc#36066), every time."""
    async def send() -> None:
        sender = GrpcStreamSender(LAYOUT, max_chunk_bytes=layer_block_nbytes(LAYOUT))  # many small chunks
        try:
            await sender.write(node.address, pool, list(range(24)), request_id="big",
                               block_hashes=[500 + i for i in range(24)])
        finally:
            await sender.close()

    for _ in range(5):
        with pytest.raises(grpc.RpcError) as e:
            asyncio.run(send())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert _read(node, [500])[0] == []


def test_a_layout_mismatch_is_refused(node, pool):
    _store(node, pool, [5], [500])
    for wrong in (PageLayout(4, 4, 16, 64, "bfloat16", 1, LAYOUT.fingerprint),
                  PageLayout(4, 2, 16, 128, "float32", 1, LAYOUT.fingerprint)):
        with pytest.raises(grpc.RpcError) as e:
            _read(node, [500], layout=wrong)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    # Another model's fingerprint names other blocks: nothing held for it.
    other_model = PageLayout(4, 4, 16, 64, "float32", 1, b"another model")
    assert _read(node, [500], layout=other_model)[0] == []
    with pytest.raises(grpc.RpcError) as e:  # a stream that changes layout midway
        def chunks():
            yield from _chunk_protos(pool, LAYOUT, [600])
            yield from _chunk_protos(pool.to(torch.bfloat16), PageLayout(4, 4, 16, 64, "bfloat16", 24,
                                                                         LAYOUT.fingerprint), [601])
        node.stub.WritePages(chunks(), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _read(node, [600])[0] == []  # the refused stream stored nothing


def _chunk_protos(pool, layout, hashes):
    return [chunk_to_proto(pool, layout, spec, list(range(len(hashes))), request_id="w", block_hashes=hashes)
            for spec in plan_chunks(layout, len(hashes))]


def test_incomplete_and_corrupt_streams_store_nothing(node, pool):
    partial = [c for c in _chunk_protos(pool, LAYOUT, [700]) if c.layer_start == 0]
    partial[0].layer_end = 1
    partial[0].data = partial[0].data[: layer_block_nbytes(LAYOUT)]
    partial[0].ClearField("checksum")
    with pytest.raises(grpc.RpcError) as e:
        node.stub.WritePages(iter(partial), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "missing layers" in e.value.details()
    corrupt = _chunk_protos(pool, LAYOUT, [701])
    corrupt[0].checksum ^= 1
    with pytest.raises(grpc.RpcError) as e:
        node.stub.WritePages(iter(corrupt), timeout=10)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert _read(node, [700])[0] == [] and _read(node, [701])[0] == []


def test_bad_flags_exit_2_and_sigterm_exits_0():
    bad = subprocess.run([sys.executable, "-m", "services.kvstore", "--capacity-bytes", "0"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--capacity-bytes" in bad.stderr
    svc = KVStoreProcess()
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.proc.wait(timeout=15) == 0
    svc.terminate()


def test_stored_blocks_enter_the_prefix_index_and_evicted_ones_leave(redis_server, redis_client, pool):
    """With --redis a node publishes what it stores under the model's key, removes what it
    evicts within a heartbeat, heartbeats as a "kvstore" instance and leaves on SIGTERM."""
    import redis.asyncio

    from services.common.registry import InstanceRegistry
    from services.kvstore.prefix_index import PrefixIndex

    node = KVStoreProcess("--capacity-bytes", str(3 * BLOCK_NBYTES), "--redis", redis_server.url,
                          "--instance-id", "tier-1")

    async def held(hashes: list[int], want: int, timeout_s: float = 3.0) -> int:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        index = PrefixIndex(r, LAYOUT.fingerprint.hex())
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            while True:
                n = (await index.match(hashes, ["tier-1"]))["tier-1"]
                if n == want or asyncio.get_running_loop().time() > deadline:
                    return n
                await asyncio.sleep(0.05)
        finally:
            await r.aclose()

    async def kinds(want: list[str], timeout_s: float = 3.0) -> list[str]:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            while True:  # the first heartbeat follows SERVING by up to one interval
                live = [i.instance_id for i in await InstanceRegistry(r).instances("kvstore")]
                if live == want or asyncio.get_running_loop().time() > deadline:
                    return live
                await asyncio.sleep(0.05)
        finally:
            await r.aclose()

    try:
        assert asyncio.run(kinds(["tier-1"])) == ["tier-1"]
        _store(node, pool, [0, 1, 2], [700, 701, 702])
        assert asyncio.run(held([700, 701, 702], 3)) == 3
        _store(node, pool, [3, 4], [703, 704])  # evicts 700 and 701
        assert asyncio.run(held([700], 0)) == 0
        assert asyncio.run(held([702, 703, 704], 3)) == 3
    finally:
        assert node.terminate() == 0
    assert asyncio.run(kinds([], timeout_s=0)) == []
    assert asyncio.run(held([702], 0, timeout_s=0)) == 0


def test_the_node_exports_what_its_tier_holds_and_serves(pool):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    node = KVStoreProcess("--capacity-bytes", str(CAPACITY_BLOCKS * BLOCK_NBYTES))
    node.stub = kvstore_pb2_grpc.KVStoreStub(node.channel)
    try:
        line = node.proc.stdout.readline()
        assert line.startswith("kvstore metrics on "), line
        url = f"http://{line.removeprefix('kvstore metrics on ').strip()}/metrics"
        _store(node, pool, [0, 1, 2], [800, 801, 802])
        assert _read(node, [800, 801, 999])[0] == [800, 801]
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url, timeout=5).text)
                   for s in f.samples}
        assert samples["baton_kv_tier_blocks"] == 3
        assert samples["baton_kv_tier_bytes_used"] == 3 * BLOCK_NBYTES
        assert samples["baton_kv_tier_capacity_bytes"] == CAPACITY_BLOCKS * BLOCK_NBYTES
        assert samples["baton_kv_tier_queried_blocks_total"] == 3
        assert samples["baton_kv_tier_hit_blocks_total"] == 2
    finally:
        assert node.terminate() == 0


def test_with_a_disk_tier_evicted_blocks_are_read_back_from_disk(pool, tmp_path):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    node = KVStoreProcess("--capacity-bytes", str(4 * BLOCK_NBYTES), "--disk-dir", str(tmp_path / "kv"),
                          "--disk-capacity-bytes", str(6 * BLOCK_NBYTES))
    node.stub = kvstore_pb2_grpc.KVStoreStub(node.channel)
    try:
        url = f"http://{node.proc.stdout.readline().removeprefix('kvstore metrics on ').strip()}/metrics"
        for first in (0, 4):  # twice what host memory holds, a stream at most as much as it does
            _store(node, pool, list(range(first, first + 4)), [900 + i for i in range(first, first + 4)])
        deadline = time.monotonic() + 10  # written on the tier's own thread
        while len(list((tmp_path / "kv").iterdir())) != 4:
            assert time.monotonic() < deadline, list((tmp_path / "kv").iterdir())
            time.sleep(0.02)
        returned, pages = _read(node, [900 + i for i in range(8)])
        assert returned == [900 + i for i in range(8)]
        assert torch.equal(pages, pool[:, :, :, list(range(8))])
        for first in (8, 12, 16):  # 20 blocks for 10 places
            _store(node, pool, list(range(first, first + 4)), [1000 + i for i in range(first, first + 4)])
        assert _read(node, [900])[0] == []  # the disk's least recently used went
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url, timeout=5).text)
                   for s in f.samples}
        assert samples["baton_kv_tier_blocks"] == 4 and samples["baton_kv_disk_tier_blocks"] == 6
        assert samples["baton_kv_disk_tier_bytes_used"] == 6 * BLOCK_NBYTES
        assert samples["baton_kv_disk_tier_hit_blocks_total"] >= 4
    finally:
        assert node.terminate() == 0
    assert list((tmp_path / "kv").iterdir()) == []  # its pages on disk went with it
