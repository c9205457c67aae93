"""Fences a decode worker's shared-memory pages against a late write by a prefill process.

A prefill process copies a reservation's pages straight into the decode worker's pool
(shm_transport.py). The decode worker may end the reservation meanwhile (its lease ran out, or the
gateway aborted it once the prefill worker stopped answering) and give the pages to another request:
a prefill that was only stalled (frozen, swapped out, descheduled) and then copies would corrupt that
request's KV, unseen.

So each page carries, in the segment, the token of the reservation it is reserved for (0: none), and
both sides take open-file-description locks (fcntl's F_OFD_SETLK) on one byte per page of the
segment's file: a writer holds a shared lock on its pages while it checks their tokens and copies;
the decode worker zeroes a reservation's tokens, then tries an exclusive lock on its pages before it
frees them, and holds back those a writer still holds (mid-copy, or frozen mid-copy) until it lets
go. A writer that finds a token changed, or cannot lock because the decode worker is ending the
reservation that very moment, copies nothing. Neither side waits for a lock: the other may be frozen
holding it. Locks go with their file's closing, so a prefill that died holds none.
"""
from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from services.kvstore.page_copy import block_runs

TOKEN_BYTES = 8
_FLOCK = struct.Struct("hhqqi4x")  # Linux's struct flock: type, whence, start, len, pid (0 for OFD locks)


class ReservationEndedError(ValueError):
    """The pages' reservation ended (expired or aborted) before they were written; nothing was."""


def token_of(reservation_id: str) -> int:
    """A reservation's token in the pages' fence: its id (16 hex digits, leases.py) as a number; 0 (no
    reservation's) for an id the decode worker did not make."""
    try:
        raw = bytes.fromhex(reservation_id)
    except ValueError:
        return 0
    return int.from_bytes(raw, "big") if len(raw) == TOKEN_BYTES else 0


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """`block_ids` as (first, count) runs of consecutive ids, each id once."""
    ids = sorted(set(block_ids))
    return [(first, count) for first, _, count in block_runs(ids, ids)]


class PageFence:
    """The fence over `num_blocks` pages whose tokens lie at `offset` of the segment at `path`, mapped here
    as `buf` (one uint64 per page). Every process that maps the segment has its own."""

    def __init__(self, path: str, buf: memoryview, offset: int, num_blocks: int) -> None:
        self.tokens = np.frombuffer(buf, dtype=np.uint64, count=num_blocks, offset=offset)
        self._fd = os.open(path, os.O_RDWR)  # its own open file description: the locks are the fence's alone

    def grant(self, reservation_id: str, block_ids: Sequence[int]) -> None:
        """The decode worker's: `block_ids` are reserved for `reservation_id` now."""
        self.tokens[list(block_ids)] = np.uint64(token_of(reservation_id))

    def revoke(self, block_ids: Sequence[int]) -> None:
        """The decode worker's: no copy into `block_ids` may start from now (one under way may go on:
        `is_unwritten` says when none is)."""
        self.tokens[list(block_ids)] = 0

    def is_unwritten(self, block_ids: Sequence[int]) -> bool:
        """Whether no writer holds any of `block_ids` (revoked, they may be freed then)."""
        taken = []
        try:
            for first, count in runs(block_ids):
                if not self._lock(fcntl.F_WRLCK, first, count):
                    return False
                taken.append((first, count))
            return True
        finally:
            for first, count in taken:
                self._lock(fcntl.F_UNLCK, first, count)

    @contextmanager
    def writing(self, reservation_id: str, block_ids: Sequence[int]) -> Iterator[None]:
        """The writer's: `block_ids` held for a copy into them under `reservation_id`. Raises
        ReservationEndedError where it ended (or is ending now)."""
        taken = []
        try:
            for first, count in runs(block_ids):
                if not self._lock(fcntl.F_RDLCK, first, count):
                    raise ReservationEndedError(f"reservation {reservation_id} is ending: its pages are not written")
                taken.append((first, count))
            token = token_of(reservation_id)
            # As a uint64: numpy 1 compares a Python int over 2**63 with uint64s as floats.
            if token == 0 or not (self.tokens[list(block_ids)] == np.uint64(token)).all():
                raise ReservationEndedError(f"reservation {reservation_id} ended (expired or aborted) before its "
                                            "pages were written; they may be another request's now")
            yield
        finally:
            for first, count in taken:
                self._lock(fcntl.F_UNLCK, first, count)

    def _lock(self, kind: int, first: int, count: int) -> bool:
        """Lock (or unlock) the bytes standing for pages `first .. first + count - 1`; False where another
        description holds a conflicting lock on any."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, first, count, 0))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def close(self) -> None:
        """Let go of the locks, the file and the view of the tokens (the segment may be unmapped then)."""
        self.tokens = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
