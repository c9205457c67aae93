"""The page fence of a KV pool that is not in shared memory (a decode worker's pool on a CUDA device).

A CPU pool's fence lives in its own segment, beside its pages (shared_memory.py). A GPU pool's pages
are reached by CUDA IPC, and a late copy into them by a stalled prefill process corrupts another
request's KV as surely (page_fence.py says how): so its decode worker makes a small segment of its
pages' tokens alone, names it in the pool's CUDA IPC handle (cuda_ipc.py), and a prefill process
attaches it to fence its copies as it would fence a shared-memory copy.

Segment = magic, the pool's number of pages (uint64), then a uint64 token per page.
"""
from __future__ import annotations

import secrets
import struct
from multiprocessing import shared_memory

from services.kvstore.layout import LayoutMismatchError
from services.kvstore.page_fence import TOKEN_BYTES, PageFence
from services.kvstore.shared_memory import NAME_PREFIX, SHM_DIR, attach_segment

MAGIC = b"BATONKF\x00"
_HEADER = struct.Struct("<8sQ")  # magic, number of pages
FENCE_PREFIX = NAME_PREFIX + "fence_"  # under the pools' prefix: a check for leftover pools sees these too


class FenceSegment:
    """The tokens of a pool of `num_blocks` pages in a named segment, and this process's fence over them."""

    def __init__(self, segment, name: str, num_blocks: int, is_owner: bool) -> None:
        self._segment = segment
        self.name = name
        self.is_owner = is_owner
        self.fence = PageFence(f"{SHM_DIR}/{name}", segment.buf, _HEADER.size, num_blocks)

    @classmethod
    def create(cls, num_blocks: int) -> FenceSegment:
        """The decode worker's: every page's token 0 (no reservation's) until it grants them."""
        name = FENCE_PREFIX + secrets.token_hex(8)
        segment = shared_memory.SharedMemory(name=name, create=True, size=_HEADER.size + num_blocks * TOKEN_BYTES)
        segment.buf[:_HEADER.size] = _HEADER.pack(MAGIC, num_blocks)
        return cls(segment, name, num_blocks, is_owner=True)

    @classmethod
    def attach(cls, name: str, num_blocks: int) -> FenceSegment:
        """A prefill process's, for a pool of `num_blocks` pages. Raises FileNotFoundError where there is
        no such segment, LayoutMismatchError where it is not the fence of such a pool."""
        if not name.startswith(FENCE_PREFIX):
            raise LayoutMismatchError(f"{name!r} does not name a KV page fence")
        segment = attach_segment(name)
        try:
            magic, found = _HEADER.unpack(bytes(segment.buf[:_HEADER.size])) \
                if segment.size >= _HEADER.size else (b"", -1)
            if magic != MAGIC or found != num_blocks or segment.size < _HEADER.size + num_blocks * TOKEN_BYTES:
                raise LayoutMismatchError(f"segment {name!r} is not the page fence of a pool of {num_blocks} pages")
            return cls(segment, name, num_blocks, is_owner=False)
        except BaseException:
            segment.close()
            raise

    def close(self) -> None:
        """Let go of the fence and unmap (the owner unlinks too)."""
        self.fence.close()
        try:
            self._segment.close()  # BufferError where a view of the tokens outlived the fence
        finally:
            if self.is_owner:
                try:
                    self._segment.unlink()
                except FileNotFoundError:
                    pass
