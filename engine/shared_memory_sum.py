"""A sum across the ranks of one host through shared memory, for the small tensors of a decode step.

gloo's all-reduce goes through the kernel's TCP loopback: about 0.45 ms a call on the 2-core VM these
tests run on, two calls a layer, most of a small model's decode step. Here each rank copies its tensor
into its own slot of a file of shared memory, raises its flag to the call's number, waits until every
rank's flag has reached it, and sums the slots in rank order (so every rank holds the same bits). The
slots alternate between two sets by call: a rank can only be two calls ahead of another once that one
has started the next call, so has read the set the first is about to overwrite.

A rank waits by polling the flags, yielding the core between looks; after `SPIN_SECONDS` it sleeps
between them instead, and calls `check_peers` (a rank that died would keep the others waiting).

Correct only where the CPU keeps stores in order for other cores (x86's TSO): a rank's data must be
seen before its flag. `is_supported()` says whether this host is one; RankGroup uses gloo elsewhere.
"""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch

SLOT_BYTES = 4 << 20  # per rank and set: a decode step's hidden states fit many times over; more goes by gloo
FLAG_STRIDE = 8  # int64s between two ranks' flags: a cache line each
SPIN_SECONDS = 0.05
SLEEP_SECONDS = 0.0005
CHECK_EVERY_SECONDS = 1.0


def is_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedMemorySum:
    def __init__(self, path: str, rank: int, size: int, check_peers: Callable[[], None] = lambda: None) -> None:
        """Maps the file `path` (made, zero-filled, where new: every rank maps the same one)."""
        self.rank, self.size = rank, size
        self._check_peers = check_peers
        flag_bytes = size * FLAG_STRIDE * 8
        mapped = torch.from_file(path, shared=True, size=flag_bytes + 2 * size * SLOT_BYTES, dtype=torch.uint8)
        self._flags = mapped[:flag_bytes].view(torch.int64).view(size, FLAG_STRIDE)[:, 0].numpy()
        self._slots = mapped[flag_bytes:].view(2, size, SLOT_BYTES)
        self._calls = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (contiguous, on the CPU, at most SLOT_BYTES) summed across the ranks, in place."""
        self._calls += 1
        call = self._calls
        slots = self._slots[call % 2, :, :tensor.numel() * tensor.element_size()].view(tensor.dtype)
        slots = slots.view(self.size, *tensor.shape)
        slots[self.rank].copy_(tensor)
        self._flags[self.rank] = call
        self._wait_for(call)
        if self.size == 2:
            torch.add(slots[0], slots[1], out=tensor)
        else:
            torch.sum(slots, dim=0, out=tensor)
        return tensor

    def _wait_for(self, call: int) -> None:
        flags = self._flags
        if flags.min() >= call:
            return
        start = last_check = time.monotonic()
        while flags.min() < call:
            now = time.monotonic()
            if now - start < SPIN_SECONDS:
                os.sched_yield()
                continue
            time.sleep(SLEEP_SECONDS)
            if now - last_check > CHECK_EVERY_SECONDS:
                self._check_peers()
                last_check = now
