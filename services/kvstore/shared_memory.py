"""A KV pool in a POSIX shared-memory segment: same-host prefill writes pages in one copy.

The decode worker owns the segment (`SharedKVPool.create`); a prefill process on the
same host maps it (`SharedKVPool.attach`) and copies its pages straight into the
reserved blocks with `page_copy.copy_pages`.

Segment = a 4 KiB header, each page's reservation token (page_fence.py: a uint64 per page,
padded to 4 KiB), then the pool tensor `[L, 2, Hkv, N, bs, D]` (page aligned). The header
(fixed little-endian struct) names the layout and model fingerprint; attach checks it against
the caller's layout and refuses a mismatch with LayoutMismatchError.

Lifetime contract: `.tensor` and every view of it borrow the mapping. Drop them all
before `close()`; a view that is still alive makes `close()` raise BufferError
(the mapping then stays valid) rather than leave a dangling pointer. The owner's
`close()` also unlinks the name (the memory goes when the last process unmaps it);
an attacher never unlinks and never registers with multiprocessing's resource_tracker,
so its exit cannot remove a segment it does not own.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
import sys
from multiprocessing import shared_memory

import numpy as np
import torch

from engine.dtypes import PAGE_DTYPES
from engine.kv_pool import PoolFile
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.page_fence import TOKEN_BYTES, PageFence

MAGIC = b"BATONKV\x00"
VERSION = 2
HEADER_BYTES = 4096
MAX_FINGERPRINT_BYTES = 64
# magic, version, data_offset, num_layers, num_kv_heads, block_size, head_dim,
# num_blocks, dtype (NUL padded), fingerprint length, fingerprint (NUL padded)
_HEADER = struct.Struct(f"<8sIIIIIIQ16sI{MAX_FINGERPRINT_BYTES}s")
NAME_PREFIX = "baton_kv_"
SHM_DIR = "/dev/shm"  # where POSIX shared memory names live on Linux


class _UntrackedMapping:
    """An existing segment mapped without resource_tracker (Python < 3.13).

    `SharedMemory(name)` before 3.13 registers even an attached segment with the
    tracker, which unlinks it when this process exits. Unregistering right after is
    not enough: processes started by one multiprocessing parent share one tracker that
    keeps one entry per name, so it would also drop the owner's registration.
    """

    def __init__(self, name: str) -> None:
        import _posixshmem  # the module SharedMemory itself uses on POSIX

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            # MAP_POPULATE: the pages are mapped here once, at attach, not one fault at a
            # time in the middle of a request's first copy into them.
            self._mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) if self.size else None
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    def close(self) -> None:
        self.buf.release()  # BufferError while a tensor view is alive
        if self._mmap is not None:
            self._mmap.close()


def attach_segment(name: str):
    """An existing segment, mapped without registering it with resource_tracker."""
    try:
        if sys.version_info >= (3, 13):
            return shared_memory.SharedMemory(name=name, track=False)
        return _UntrackedMapping(name)
    except FileNotFoundError:
        raise FileNotFoundError(f"no shared KV pool segment named {name!r} (is the decode worker running?)") from None


def _allocate(name: str, size: int) -> None:
    import _posixshmem  # the module SharedMemory itself uses on POSIX

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise OSError(e.errno, f"cannot allocate a {size}-byte KV pool in shared memory (/dev/shm): {e.strerror}"
                      ) from None
    finally:
        os.close(fd)


def data_offset(num_blocks: int) -> int:
    """Where a pool of `num_blocks` pages starts in its segment: after the header and the pages' tokens,
    page aligned (so the tensor is too)."""
    return HEADER_BYTES + -(-num_blocks * TOKEN_BYTES // 4096) * 4096


def _pack_header(layout: PageLayout) -> bytes:
    if len(layout.fingerprint) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint is {len(layout.fingerprint)} bytes, at most {MAX_FINGERPRINT_BYTES} fit")
    return _HEADER.pack(
        MAGIC, VERSION, data_offset(layout.num_blocks), layout.num_layers, layout.num_kv_heads, layout.block_size,
        layout.head_dim, layout.num_blocks, layout.dtype.encode("ascii"), len(layout.fingerprint), layout.fingerprint,
    )


def _unpack_header(name: str, raw: bytes) -> PageLayout:
    if len(raw) < _HEADER.size:
        raise LayoutMismatchError(f"segment {name!r} is too small to hold a Baton KV pool header")
    (magic, version, found_offset, num_layers, num_kv_heads, block_size, head_dim, num_blocks, dtype,
     fp_len, fingerprint) = _HEADER.unpack(raw[: _HEADER.size])
    if magic != MAGIC:
        raise LayoutMismatchError(f"segment {name!r} is not a Baton KV pool (magic {magic!r})")
    if version != VERSION or found_offset != data_offset(num_blocks):
        raise LayoutMismatchError(f"segment {name!r} has header version {version}, this build reads {VERSION}")
    return PageLayout(
        num_layers=num_layers, num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim,
        dtype=dtype.rstrip(b"\x00").decode("ascii"), num_blocks=num_blocks, fingerprint=fingerprint[:fp_len],
    )


def _pool_view(buf: memoryview, layout: PageLayout) -> torch.Tensor:
    # Through numpy rather than torch.frombuffer: numpy holds the buffer export, so a
    # live view makes close() fail loudly; torch.frombuffer releases it and the view
    # would dangle (a segfault on use) after close().
    raw = np.frombuffer(buf, dtype=np.uint8, count=layout.nbytes, offset=data_offset(layout.num_blocks))
    return torch.from_numpy(raw).view(PAGE_DTYPES[layout.dtype]).view(layout.shape)


class SharedKVPool:
    """A paged KV pool `[L, 2, Hkv, N, bs, D]` in a named shared-memory segment."""

    def __init__(self, segment, name: str, layout: PageLayout, is_owner: bool) -> None:
        self._segment = segment
        self.name = name
        self.layout = layout
        self.is_owner = is_owner
        self.tensor: torch.Tensor | None = _pool_view(segment.buf, layout)
        self.fence = PageFence(f"{SHM_DIR}/{name}", segment.buf, HEADER_BYTES, layout.num_blocks)
        self._is_closed = False

    @classmethod
    def create(cls, layout: PageLayout, name: str | None = None) -> SharedKVPool:
        """Create the segment and own it. Its memory is allocated and mapped now, as a GPU
        pool is carved at start-up: /dev/shm too small fails here with OSError (not SIGBUS
        mid-request), and no request pays the page faults of a first write."""
        name = name or NAME_PREFIX + secrets.token_hex(8)
        header = _pack_header(layout)
        size = data_offset(layout.num_blocks) + layout.nbytes
        segment = shared_memory.SharedMemory(name=name, create=True, size=size)
        try:
            _allocate(name, size)
            segment.buf[: len(header)] = header
            pool = cls(segment, name, layout, is_owner=True)
            pool.tensor.zero_()  # maps every page in this process (already zero: allocated by fallocate)
            return pool
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    @classmethod
    def attach(cls, name: str, layout: PageLayout) -> SharedKVPool:
        """Map an existing pool. `layout` must match it in all but num_blocks (the segment's wins)."""
        segment = attach_segment(name)
        try:
            found = _unpack_header(name, bytes(segment.buf[: _HEADER.size]))
            layout.check_compatible(found)
            needed = data_offset(found.num_blocks) + found.nbytes
            if segment.size < needed:
                raise LayoutMismatchError(f"segment {name!r} is {segment.size} bytes, its layout needs {needed}")
            return cls(segment, name, found, is_owner=False)
        except BaseException:
            segment.close()
            raise

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def pool_file(self) -> PoolFile:
        """Where its tensor lies, for the engine's other tensor-parallel ranks to map (Linux names a POSIX
        segment so under /dev/shm)."""
        return PoolFile(f"{SHM_DIR}/{self.name}", data_offset(self.num_blocks))

    def close(self) -> None:
        """Unmap (and, for the owner, unlink). Every view of `.tensor` must be gone first."""
        if self._is_closed:
            return
        self.tensor = None
        self.fence.close()
        try:
            self._segment.close()
        except BufferError:
            raise BufferError(
                f"shared KV pool {self.name!r}: tensor views are still alive; drop them before close()"
            ) from None
        finally:
            if self.is_owner:
                self.unlink()
        self._is_closed = True

    def unlink(self) -> None:
        """Remove the name (owner only); processes that mapped it keep their mapping."""
        if not self.is_owner:
            raise PermissionError(f"shared KV pool {self.name!r}: only the owner may unlink it")
        try:
            self._segment.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedKVPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
