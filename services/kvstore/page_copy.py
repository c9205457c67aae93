"""Copying and checksumming whole KV blocks between pool tensors `[L, 2, Hkv, N, bs, D]`.

Why runs of blocks and not one index_select/index_copy_: measured on this host's CPU
(256 MiB of 1 MiB blocks, bf16, into a shared-memory pool), index_select + index_copy_
moved 0.9-1.5 GB/s (it gathers into a temporary, then scatters: two passes, and the
bf16 strided path is slow), while a byte-view slice copy per run of consecutive block
ids moved 4.6-6.7 GB/s against 5-8 GB/s for a plain contiguous copy_. Prefill's fresh
pages and decode's reservations are mostly long runs, so the loop is over runs, not
blocks; a fully scattered list costs one small Python step per (1 MiB-ish) block.
On a GPU a run is one strided copy kernel, where index_select/index_copy_ makes two
passes through a temporary after uploading two index tensors (each upload a wait on the
host), so runs go first there too; a list scattered over more than MAX_RUN_COPIES runs,
where a launch per run would cost more, takes the indexed path.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

_BLOCK_DIM = 3  # of [L, 2, Hkv, N, bs, D]
MAX_RUN_COPIES = 16  # beyond it a GPU copy gathers by index: a launch per run costs more


def _check_pool(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 6 or tensor.shape[1] != 2:
        raise ValueError(f"{name}: a KV pool tensor is [L, 2, Hkv, N, bs, D], got shape {tuple(tensor.shape)}")


def _check_blocks(name: str, blocks: list[int], num_blocks: int) -> None:
    for b in blocks:
        if not 0 <= b < num_blocks:
            raise ValueError(f"{name}: block id {b} out of range [0, {num_blocks})")


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for maximal runs consecutive on both sides."""
    if len(src_blocks) > _VECTOR_RUNS_FROM:
        return _vector_block_runs(src_blocks, dst_blocks)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


_VECTOR_RUNS_FROM = 64  # blocks: below it the Python loop is the quicker (numpy's setup costs ~20 us)


def _vector_block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    src = np.fromiter(src_blocks, dtype=np.int64, count=len(src_blocks))
    dst = np.fromiter(dst_blocks, dtype=np.int64, count=len(dst_blocks))
    starts = np.concatenate(([0], np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1))
    lengths = np.diff(np.append(starts, len(src)))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist()))


def _as_rows_of_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # [L, 2, Hkv, N, bs, D] -> [L*2*Hkv, N, bs*D*itemsize] uint8: a bit-exact copy in
    # any dtype, and torch's fast byte path (the bf16 strided path is ~10x slower).
    num_layers, _, num_kv_heads, num_blocks = tensor.shape[:4]
    return tensor.view(torch.uint8).view(num_layers * 2 * num_kv_heads, num_blocks, -1)


def copy_pages(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int]) -> int:
    """Copy whole blocks (all layers, K and V) `src[..., src_blocks[i]]` -> `dst[..., dst_blocks[i]]`.

    Both tensors are contiguous pools `[L, 2, Hkv, N, bs, D]` of the same dtype and the
    same shape but for N. Returns the bytes copied. Raises ValueError on unequal
    lengths, out-of-range block ids or incompatible pools; nothing is written then.
    Duplicate destination ids are a caller bug (the last write wins).
    """
    _check_pool("src", src)
    _check_pool("dst", dst)
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: src {src.dtype}, dst {dst.dtype}")
    src_page_shape = src.shape[:_BLOCK_DIM] + src.shape[_BLOCK_DIM + 1 :]
    dst_page_shape = dst.shape[:_BLOCK_DIM] + dst.shape[_BLOCK_DIM + 1 :]
    if src_page_shape != dst_page_shape:
        raise ValueError(
            f"pool shapes differ beyond the block dim: src {tuple(src.shape)}, dst {tuple(dst.shape)}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_pages needs contiguous pool tensors")
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    _check_blocks("src_blocks", src_blocks, src.shape[_BLOCK_DIM])
    _check_blocks("dst_blocks", dst_blocks, dst.shape[_BLOCK_DIM])
    if not src_blocks:
        return 0
    block_nbytes = src.numel() // src.shape[_BLOCK_DIM] * src.element_size()
    runs = block_runs(src_blocks, dst_blocks)
    if (src.device.type == "cpu" and dst.device.type == "cpu") or len(runs) <= MAX_RUN_COPIES:
        src_rows, dst_rows = _as_rows_of_bytes(src), _as_rows_of_bytes(dst)
        for s, d, n in runs:
            dst_rows[:, d : d + n].copy_(src_rows[:, s : s + n])
    else:
        src_idx = torch.tensor(src_blocks, device=src.device)
        dst_idx = torch.tensor(dst_blocks, device=dst.device)
        dst.index_copy_(_BLOCK_DIM, dst_idx, src.index_select(_BLOCK_DIM, src_idx).to(dst.device))
    return block_nbytes * len(src_blocks)


def gather_pages(tensor: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """`tensor[:, :, :, blocks]` as a new contiguous CPU tensor `[L, 2, Hkv, len(blocks), bs, D]`.

    Its bytes are exactly a kvstore.proto PageChunk's `data` for the full layer range.
    """
    _check_pool("tensor", tensor)
    _check_blocks("blocks", blocks, tensor.shape[_BLOCK_DIM])
    idx = torch.tensor(blocks, dtype=torch.long, device=tensor.device)
    return tensor.index_select(_BLOCK_DIM, idx).cpu().contiguous()


def page_checksum(tensor: torch.Tensor, blocks: list[int]) -> int:
    """CRC-32 (zlib.crc32) of `tensor[:, :, :, blocks]`'s raw little-endian bytes.

    Equal to PageChunk.checksum of a chunk carrying those blocks over all layers, so
    both ends of any transport can compare it.
    """
    data = gather_pages(tensor, blocks)
    return zlib.crc32(data.view(-1).view(torch.uint8).numpy())
