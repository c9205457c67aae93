"""The paged KV pool: one tensor carved once at start-up, viewed per layer."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.model_config import ModelConfig

# (shape, dtype, device) → a zero-filled contiguous tensor that will hold the pool.
TensorFactory = Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor]


@dataclass(frozen=True)
class PoolFile:
    """Where a KV pool placed in a file of shared memory lies: what another process of this host maps to
    compute in the same pages (a rank of a model split across ranks, engine/tensor_parallel_workers.py)."""

    path: str
    offset: int = 0  # of the pool's first byte in the file


# (shape, dtype, device) → a TensorFactory's tensor, placed in a file of shared memory, and where it lies.
SharedTensorFactory = Callable[[tuple[int, ...], torch.dtype, str], tuple[torch.Tensor, PoolFile]]


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_kv_layers * config.page_kv_heads * block_size * config.head_dim * itemsize


def num_state_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """The pages each sequence holds for a hybrid model's recurrent states (engine/recurrent_state.py); 0 for a
    model without them."""
    shape = config.state_shape
    return shape.num_pages(kv_block_bytes(config, block_size, dtype)) if shape is not None else 0


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def utilization_pool_bytes(utilization: float, total: int, held: int, free: int) -> int:
    """The KV pool's bytes under vLLM's --gpu-memory-utilization, sized as SGLang sizes its
    --mem-fraction-static: the weights and the pool of this process within `utilization` of the
    device's `total` memory, a step's activations in the rest. `held`: what the process holds now
    (its weights, a draft model's); `free`: the device's free memory. ValueError when the weights
    leave no room, or the room is more than is free (other processes hold it)."""
    budget = int(utilization * total)
    room = budget - held
    if room <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} gives this worker {_gib(budget)} of the device's "
                         f"{_gib(total)} and its weights take {_gib(held)}: no room is left for KV pages")
    if room > free:
        raise ValueError(f"--gpu-memory-utilization {utilization} asks for {_gib(room)} of KV pages beside the "
                         f"weights, but {_gib(free)} of the device's {_gib(total)} is free (other processes hold "
                         f"the rest): ask for less, or for a KV pool size (--kv-cache-memory-bytes)")
    return room


def device_pool_bytes(device: str, utilization: float) -> int:
    """`utilization_pool_bytes` on CUDA device `device`, for this process as it stands."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return utilization_pool_bytes(utilization, total, torch.cuda.memory_reserved(torch.device(device)), free)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def num_pool_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, device: str, num_bytes: int | None,
                    num_blocks: int | None, fraction: float, other_block_bytes: int = 0) -> int:
    """The pool's blocks: as many as `num_bytes` holds (ValueError where it holds none), else `num_blocks`,
    else what `fraction` of the free memory holds (EngineConfig's sizes); `other_block_bytes`: what
    another pool of as many blocks (a draft model's) takes a block."""
    if num_bytes is None:
        return num_blocks or num_blocks_for_budget(config, block_size, dtype, device, fraction, other_block_bytes)
    block_bytes = kv_block_bytes(config, block_size, dtype) + other_block_bytes
    if num_bytes < block_bytes:
        raise ValueError(f"a KV pool of {num_bytes} bytes holds no block: one takes {block_bytes} bytes here")
    return num_bytes // block_bytes


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, device: str,
                          fraction: float, other_block_bytes: int = 0) -> int:
    """Blocks that `fraction` of the free memory holds; `other_block_bytes`: what another pool of as
    many blocks (a draft model's) takes a block."""
    block_bytes = kv_block_bytes(config, block_size, dtype) + other_block_bytes
    return max(1, int(available_memory_bytes(device) * fraction) // block_bytes)


def pool_shape(config: ModelConfig, num_blocks: int, block_size: int, extra_layers: int = 0) -> tuple[int, ...]:
    """`[L, 2, Hkv, N, bs, D]`: a KVPool tensor's (`extra_layers` past the model's: an EAGLE head's)."""
    return config.num_kv_layers + extra_layers, 2, config.page_kv_heads, num_blocks, block_size, config.head_dim


class KVPool:
    """K and V pages for every layer.

    `tensor` is `[L, 2, Hkv, N, bs, D]`: one allocation, so it can later live in
    shared memory or be exported as one CUDA IPC handle. A rank of a model split across ranks
    (engine/tensor_parallel.py) computes with its `heads` of every page: `layers` views those alone.
    `extra_layers` past the model's are an EAGLE head's (engine/eagle.py), so that every page holds the
    head's KV beside the model's wherever it goes.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        tensor_factory: TensorFactory | None = None,
        heads: slice = slice(None),
        extra_layers: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = pool_shape(config, num_blocks, block_size, extra_layers)
        # A decode worker passes a factory that places the pool in shared memory,
        # so a prefill worker on the same host can write pages into it directly.
        self.tensor = (tensor_factory or _zeros)(shape, dtype, device)
        if self.tensor.shape != shape or self.tensor.dtype != dtype or not self.tensor.is_contiguous():
            raise ValueError(f"KV pool tensor must be contiguous {dtype} {shape}, "
                             f"got {self.tensor.dtype} {tuple(self.tensor.shape)}")
        self.layers = [(self.tensor[i, 0, heads], self.tensor[i, 1, heads]) for i in range(config.num_kv_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    # Pages must start finite (masked padding still flows through P @ V), but
    # torch.zeros would touch every byte of a multi-GiB pool at start-up.
    # calloc'd memory is zeroed by the OS page by page on first use instead.
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(math.prod(shape) * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)
