"""Pages cut into PageChunks of at most 2 MiB and put back: byte-exact, in every layout,
and every received chunk checked before it is used."""
from __future__ import annotations

import pytest
import torch

from engine.dtypes import TORCH_DTYPES
from services.kvstore.converters import ChecksumError, chunk_from_proto, chunk_to_proto
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.page_chunks import (
    MAX_CHUNK_BYTES,
    ChunkSpec,
    chunk_nbytes,
    plan_chunks,
    scatter_chunk,
)

FINGERPRINT = b"\x01" * 32


def _pool(layout: PageLayout, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=g).to(TORCH_DTYPES[layout.dtype])


LAYOUTS = {
    # name: (layout, blocks sent)
    "tiny-f32": (PageLayout(2, 2, 16, 16, "float32", 64, FINGERPRINT), [5, 6, 7, 40, 2]),
    "llama-bf16": (PageLayout(8, 8, 16, 128, "bfloat16", 48, FINGERPRINT), list(range(10, 40))),
    # One layer of the blocks is 2.5 MiB: layers are split by block ids too.
    "one-layer-over-2MiB": (PageLayout(3, 8, 16, 128, "float32", 40, FINGERPRINT), list(range(39, -1, -2))),
    "fp16-one-block": (PageLayout(5, 1, 8, 64, "float16", 4, FINGERPRINT), [3]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_chunks_stay_under_the_limit_and_reassemble_byte_exact(name):
    layout, src_blocks = LAYOUTS[name]
    src = _pool(layout)
    dst = torch.zeros_like(src)
    dst_blocks = [(b * 7 + 3) % layout.num_blocks for b in range(len(src_blocks))]
    assert len(set(dst_blocks)) == len(dst_blocks)
    specs = plan_chunks(layout, len(src_blocks))
    covered = set()
    for spec in specs:
        chunk = chunk_to_proto(src, layout, spec, src_blocks, request_id="r", reservation_id="res",
                               dst_blocks=dst_blocks)
        assert 0 < len(chunk.data) <= MAX_CHUNK_BYTES
        assert chunk.HasField("checksum") and chunk.layout.model_fingerprint == FINGERPRINT
        received = chunk_from_proto(chunk, layout)
        scatter_chunk(dst, received.block_ids, received.layer_start, received.pages)
        covered |= {(layer, b) for layer in range(spec.layer_start, spec.layer_end) for b in received.block_ids}
    assert covered == {(layer, b) for layer in range(layout.num_layers) for b in dst_blocks}
    expected = torch.zeros_like(src)
    expected[:, :, :, dst_blocks] = src[:, :, :, src_blocks]
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_plan_splits_by_layers_first_then_by_blocks():
    small = PageLayout(4, 2, 16, 16, "float32", 64, FINGERPRINT)  # 4 KiB per layer-block
    assert plan_chunks(small, 10) == [ChunkSpec(0, 4, 0, 10)]
    assert plan_chunks(small, 10, max_bytes=2 * 40960) == [ChunkSpec(0, 2, 0, 10), ChunkSpec(2, 4, 0, 10)]
    assert plan_chunks(small, 10, max_bytes=3 * 4096) == [
        ChunkSpec(layer, layer + 1, b, min(b + 3, 10)) for layer in range(4) for b in (0, 3, 6, 9)]
    assert plan_chunks(small, 0) == []
    assert plan_chunks(small, 3, layer_start=1, layer_end=3) == [ChunkSpec(1, 3, 0, 3)]
    with pytest.raises(ValueError, match="chunk limit"):
        plan_chunks(small, 1, max_bytes=4095)
    with pytest.raises(ValueError, match="layer range"):
        plan_chunks(small, 1, layer_start=3, layer_end=5)
    assert chunk_nbytes(small, 2, 3) == 2 * 3 * 4096


def _one_chunk(layout, **kwargs):
    src = _pool(layout)
    return chunk_to_proto(src, layout, plan_chunks(layout, 2)[0], [0, 1], request_id="r", reservation_id="res",
                          dst_blocks=[3, 4], **kwargs)


def test_received_chunks_are_checked():
    layout = PageLayout(2, 2, 16, 16, "float32", 8, FINGERPRINT)
    corrupt = _one_chunk(layout)
    corrupt.data = bytes([corrupt.data[0] ^ 1]) + corrupt.data[1:]
    with pytest.raises(ChecksumError):
        chunk_from_proto(corrupt, layout)
    unchecked = _one_chunk(layout, checksum=False)
    assert not unchecked.HasField("checksum")
    unchecked.data = unchecked.data[:-4]
    with pytest.raises(ValueError, match="bytes"):
        chunk_from_proto(unchecked, layout)
    with pytest.raises(LayoutMismatchError, match="fingerprint"):
        chunk_from_proto(_one_chunk(layout), PageLayout(2, 2, 16, 16, "float32", 8, b"another model"))
    with pytest.raises(LayoutMismatchError, match="dtype"):
        chunk_from_proto(_one_chunk(layout), PageLayout(2, 2, 16, 16, "bfloat16", 8, FINGERPRINT))
    bad_range = _one_chunk(layout)
    bad_range.layer_end = 3
    with pytest.raises(ValueError, match="layer range"):
        chunk_from_proto(bad_range, layout)
    unnamed = _one_chunk(layout)
    unnamed.ClearField("block_ids")
    with pytest.raises(ValueError, match="at least one block"):
        chunk_from_proto(unnamed, layout)
    both = _one_chunk(layout)
    both.block_hashes.extend([1, 2])
    with pytest.raises(ValueError, match="not both"):
        chunk_from_proto(both, layout)
