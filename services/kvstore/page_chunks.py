"""Cutting a pool's pages into bounded chunks, and putting chunks back into a pool.

A chunk is `pool[layer_start:layer_end, :, :, blocks]`: `[l, 2, Hkv, nb, bs, D]`,
contiguous, little-endian (kvstore.proto PageChunk.data). Chunks go layer range by
layer range (so a later sender can start on the first layers while the rest are
computed), and a layer's blocks are split only when one layer of them alone is over
the limit. Everything moves as bytes: a bit-exact copy in any dtype, and torch's fast
byte path (the strided bf16 path is ~10x slower, see page_copy.py).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

from services.kvstore.layout import PageLayout
from services.kvstore.page_copy import block_runs

MAX_CHUNK_BYTES = 2 * 1024 * 1024  # kvstore.proto's bound on one PageChunk's data


class ChunkSpec(NamedTuple):
    """Layers [layer_start, layer_end) of the blocks at positions [first, last) of a block list."""
    layer_start: int
    layer_end: int
    first: int
    last: int


def layer_block_nbytes(layout: PageLayout) -> int:
    """Bytes of one block in one layer, K and V."""
    return 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * layout.itemsize


def chunk_nbytes(layout: PageLayout, num_layers: int, num_blocks: int) -> int:
    return num_layers * num_blocks * layer_block_nbytes(layout)


def plan_chunks(layout: PageLayout, num_blocks: int, layer_start: int = 0, layer_end: int | None = None,
                max_bytes: int = MAX_CHUNK_BYTES) -> list[ChunkSpec]:
    """Chunks of at most `max_bytes` covering `num_blocks` blocks over layers [layer_start, layer_end).

    Raises ValueError when one layer of one block is already over `max_bytes`
    (a page cannot be split further on the wire).
    """
    layer_end = layout.num_layers if layer_end is None else layer_end
    if not 0 <= layer_start < layer_end <= layout.num_layers:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside [0, {layout.num_layers})")
    page = layer_block_nbytes(layout)
    if page > max_bytes:
        raise ValueError(f"one layer of one block is {page} bytes, over the {max_bytes}-byte chunk limit")
    if num_blocks == 0:
        return []
    layer_nbytes = page * num_blocks
    if layer_nbytes <= max_bytes:  # whole layers of all blocks per chunk
        step = max_bytes // layer_nbytes
        return [ChunkSpec(a, min(a + step, layer_end), 0, num_blocks) for a in range(layer_start, layer_end, step)]
    step = max_bytes // page  # one layer per chunk, its blocks split
    return [ChunkSpec(a, a + 1, b, min(b + step, num_blocks))
            for a in range(layer_start, layer_end) for b in range(0, num_blocks, step)]


def _byte_pages(pool: torch.Tensor) -> torch.Tensor:
    # [L, 2, Hkv, N, bs, D] -> [L, 2*Hkv, N, bs*D*itemsize] uint8 (a view)
    num_layers, _, num_kv_heads, num_blocks = pool.shape[:4]
    return pool.view(torch.uint8).view(num_layers, 2 * num_kv_heads, num_blocks, -1)


def gather_chunk(pool: torch.Tensor, blocks: Sequence[int], layer_start: int, layer_end: int,
                 staging: torch.Tensor | None = None) -> torch.Tensor:
    """`pool[layer_start:layer_end, :, :, blocks]` as a contiguous CPU uint8 tensor (a chunk's bytes).

    Written into the front of `staging` (flat uint8, reused across chunks: a fresh
    buffer per chunk costs a page fault per 4 KiB, slower here than the copy) when
    given. Callers pass block ids already checked against the pool (a request's held pages)."""
    src = _byte_pages(pool)[layer_start:layer_end]
    if pool.device.type != "cpu":
        idx = torch.tensor(list(blocks), dtype=torch.long, device=pool.device)
        return src.index_select(2, idx).cpu().contiguous()
    shape = (src.shape[0], src.shape[1], len(blocks), src.shape[3])
    if staging is None:
        out = torch.empty(shape, dtype=torch.uint8)
    else:
        out = staging[: src.shape[0] * src.shape[1] * len(blocks) * src.shape[3]].view(shape)
    for s, i, n in block_runs(blocks, range(len(blocks))):
        out[:, :, i : i + n].copy_(src[:, :, s : s + n])
    return out


def scatter_chunk(pool: torch.Tensor, blocks: Sequence[int], layer_start: int, chunk: torch.Tensor) -> None:
    """Write a chunk's pages (uint8 `[l, 2*Hkv, nb, bs*D*itemsize]`, see `chunk_view`) into
    `pool[layer_start:layer_start + l, :, :, blocks]`. Callers check the blocks and shape first."""
    dst = _byte_pages(pool)[layer_start : layer_start + chunk.shape[0]]
    if pool.device.type != "cpu":
        idx = torch.tensor(list(blocks), dtype=torch.long, device=pool.device)
        dst.index_copy_(2, idx, chunk.to(pool.device))
        return
    for i, d, n in block_runs(range(len(blocks)), blocks):
        dst[:, :, d : d + n].copy_(chunk[:, :, i : i + n])


def chunk_view(data: bytes, layout: PageLayout, num_layers: int, num_blocks: int) -> torch.Tensor:
    """A read-only uint8 view `[l, 2*Hkv, nb, bs*D*itemsize]` over a chunk's bytes, without a copy.

    Raises ValueError when `data` is not exactly that many bytes."""
    expected = chunk_nbytes(layout, num_layers, num_blocks)
    if len(data) != expected:
        raise ValueError(f"chunk data is {len(data)} bytes; {num_layers} layers of {num_blocks} blocks "
                         f"in this layout are {expected}")
    if expected == 0:
        raise ValueError("a chunk holds at least one layer of one block")
    # torch warns that bytes are not writable: the view is only ever read. It keeps `data` alive.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(num_layers, 2 * layout.num_kv_heads, num_blocks, -1)
