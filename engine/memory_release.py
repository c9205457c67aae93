"""An idle engine giving its memory back to the host, and taking it again (SGLang's
release_memory_occupation and resume_memory_occupation, vLLM's sleep and wake_up): an RL loop
frees the serving side's memory for the trainer between rollouts.

What is released stays mapped, so nothing that points into it changes (the model's views of its
weights, a prefill worker's mapping of a decode worker's shared pool): its pages go back with
madvise, and read as zeros until written. So the KV cache comes back empty (its prefix cache is
forgotten first), and the weights are read again from the checkpoint the engine serves
(`weights_dir`: its model, or the last weight update's) when they come back. Only the pages wholly
inside a tensor's storage are released: a page it shares with other memory stays. A model split
across tensor-parallel ranks gives back every rank's weights, and its KV pool, one file of shared
memory every rank maps, once for all of them.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Iterable

import torch

KINDS = ("weights", "kv_cache")  # SGLang's tags (its cuda_graph has no counterpart on a CPU)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class MemoryBusyError(RuntimeError):
    """Requests are in the engine (running, waiting or holding reserved pages), or its memory is not
    host memory: nothing is released."""


def release_pages(tensor: torch.Tensor) -> int:
    """Give back the pages wholly inside `tensor`'s storage; the bytes given back. Shared memory (a
    tmpfs segment) is freed with MADV_REMOVE, private memory with MADV_DONTNEED (which would only
    unmap a shared page, leaving the segment holding it)."""
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (storage.data_ptr() + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return 0
    if _libc.madvise(start, end - start, mmap.MADV_REMOVE) != 0:
        if ctypes.get_errno() != errno.EINVAL:  # EINVAL: not shared memory
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        if _libc.madvise(start, end - start, mmap.MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return end - start


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage (a tied LM head shares the embedding's)."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        seen.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return list(seen.values())


def release(engine, kinds: Iterable[str]) -> int:
    """Release `kinds` of an idle `engine`'s memory (see KINDS); the bytes given back. MemoryBusyError
    while requests are in it. Until its weights come back (`resume`) it takes no request."""
    kinds = check_kinds(kinds)
    if engine.config.device != "cpu":
        # madvise gives back host pages; device memory would need its physical pages unmapped under
        # addresses kept (CUDA's virtual memory API), which the engine does not do yet.
        raise MemoryBusyError(f"the engine's memory is on {engine.config.device}: only host memory is released")
    if engine.has_unfinished_requests():
        raise MemoryBusyError("requests are running or waiting in the engine")
    released = 0
    if "kv_cache" in kinds:
        if engine.reset_prefix_cache() is None:
            raise MemoryBusyError("requests hold KV pages (reserved, or handed over)")
        released += sum(release_pages(t) for t in unique_storages(engine.kv_pool_tensors()))
    if "weights" in kinds:  # the model's, and its drafter's (which may share some of them)
        drafter = _drafter_with_weights(engine)
        drafting = drafter.runner.model.parameters() if drafter is not None else ()
        released += sum(release_pages(p) for p in unique_storages([*engine.runner.model.parameters(), *drafting]))
        if engine.runner.rank_workers is not None:  # a split model's other ranks give back theirs
            released += engine.runner.rank_workers.release_weights()
    engine.released_memory |= set(kinds)
    return released


def resume(engine, kinds: Iterable[str]) -> None:
    """Take `kinds` of `engine`'s memory back: its weights read again from `engine.weights_dir` (a drafter's from its
    own); its KV pages as they are touched (nothing to do)."""
    kinds = check_kinds(kinds)
    if "weights" in kinds and "weights" in engine.released_memory:
        engine.reload_weights()  # (an MTP layer's too: the served checkpoint holds it)
        drafter = _drafter_with_weights(engine)
        if drafter is not None and not drafter.reads_served_checkpoint:
            drafter.runner.load_weights(drafter.model_dir)
    engine.released_memory -= set(kinds)


def _drafter_with_weights(engine):
    """The engine's drafter of weights of its own (a draft model, an EAGLE head, an MTP layer, a Gemma 4
    assistant); None for n-gram drafts or none."""
    drafter = engine.scheduler.drafter
    return drafter if getattr(drafter, "runner", None) is not None else None


def check_kinds(kinds: Iterable[str]) -> set[str]:
    kinds = set(kinds)
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        raise ValueError(f"unknown memory kind {unknown[0]!r}: one of {', '.join(KINDS)}")
    return kinds
