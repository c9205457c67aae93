"""An idle engine giving its weights' and KV pool's memory back to the host and taking it again
(SGLang's release/resume_memory_occupation, vLLM's sleep/wake_up): the pages leave the process
(mincore says none is resident), it takes no request while its weights are away, and once they are
back it computes what it computed before, from the checkpoint it serves."""
from __future__ import annotations

import ctypes
import mmap
import os
from multiprocessing import shared_memory

import pytest
import torch

from engine.demo_model import make_demo_model
from engine.memory_release import MemoryBusyError, release, release_pages, resume, unique_storages
from engine.sampling_params import SamplingParams
from tests.unit.test_engine import assert_pool_clean, run_all
from tests.unit.test_weight_update import GREEDY, PROMPT, SHAPE, make_engine

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages wholly inside `tensor`'s storage that are in memory now (mincore)."""
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (storage.data_ptr() + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return 0
    pages = ctypes.create_string_buffer((end - start) // mmap.PAGESIZE)
    assert _libc.mincore(start, end - start, pages) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in pages.raw) * mmap.PAGESIZE


def test_private_pages_leave_the_process_and_read_as_zeros():
    tensor = torch.ones(8 * 2**20 // 4)
    assert resident_bytes(tensor) >= 8 * 2**20 - 2 * mmap.PAGESIZE
    released = release_pages(tensor)
    assert released >= 8 * 2**20 - 2 * mmap.PAGESIZE and resident_bytes(tensor) == 0
    assert tensor[mmap.PAGESIZE:-mmap.PAGESIZE].abs().sum() == 0  # the interior: the edges may share pages


def test_a_shared_segments_pages_are_freed_for_every_process_mapping_it():
    segment = shared_memory.SharedMemory(create=True, size=8 * 2**20)
    other = shared_memory.SharedMemory(name=segment.name)  # as a prefill worker maps a decode worker's pool
    try:
        tensor = torch.frombuffer(segment.buf, dtype=torch.uint8)
        tensor.fill_(7)
        path = f"/dev/shm/{segment.name}"
        assert os.stat(path).st_blocks * 512 >= 8 * 2**20
        assert release_pages(tensor) == 8 * 2**20
        assert os.stat(path).st_blocks == 0  # the segment holds no page: the host has them back
        assert bytes(other.buf[:16]) == bytes(16)
        del tensor
    finally:
        other.close()
        segment.close()
        segment.unlink()


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory):
    """Megabytes of weights, so that their pages are most of their memory."""
    return make_demo_model(tmp_path_factory.mktemp("wide") / "wide", seed=3, **{**SHAPE, "hidden_size": 256,
                                                                                   "vocab_size": 4096})


def test_released_weights_and_pages_come_back_computing_as_before(wider_model):
    engine = make_engine(wider_model)
    before = run_all(engine, {"a": (PROMPT, GREEDY)})["a"]
    weights = unique_storages(engine.runner.model.parameters())
    held = sum(resident_bytes(w) for w in weights)
    assert held > 4 * 2**20
    assert release(engine, ["weights", "kv_cache"]) >= held
    assert sum(resident_bytes(w) for w in weights) == 0
    assert sum(resident_bytes(t) for t in engine.kv_pool_tensors()) == 0
    with pytest.raises(ValueError, match="weights are released"):
        engine.add_request("asleep", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="weights are released"):
        engine.reserve("asleep", 8)
    resume(engine, ["weights", "kv_cache"])
    after = run_all(engine, {"b": (PROMPT, GREEDY)})["b"]
    assert after.token_ids == before.token_ids and after.num_cached_tokens == 0  # the prefix cache went too
    assert_pool_clean(engine)


def test_only_the_kv_cache_keeps_the_weights_and_an_update_brings_released_ones_back(tiny_demo_model,
                                                                                   wider_model):
    engine = make_engine(tiny_demo_model)
    before = run_all(engine, {"a": (PROMPT, GREEDY)})["a"]
    release(engine, ["kv_cache"])
    assert run_all(engine, {"b": (PROMPT, GREEDY)})["b"].token_ids == before.token_ids
    release(engine, ["weights"])
    assert engine.update_weights(tiny_demo_model) is not None  # a trainer's checkpoint, read while asleep
    assert engine.released_memory == {"kv_cache"}
    assert run_all(engine, {"c": (PROMPT, GREEDY)})["c"].token_ids == before.token_ids


def test_nothing_is_released_while_a_request_is_in_the_engine_or_for_an_unknown_kind(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    engine.add_request("running", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    with pytest.raises(MemoryBusyError):
        release(engine, ["weights"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.reserve("handed-over", 8)
    with pytest.raises(MemoryBusyError, match="hold KV pages"):
        release(engine, ["kv_cache"])
    engine.release_reservation("handed-over")
    with pytest.raises(ValueError, match="unknown memory kind 'cuda_graph'"):
        release(engine, ["cuda_graph"])
    assert engine.released_memory == set()
