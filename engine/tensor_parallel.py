"""Tensor parallelism (vLLM's --tensor-parallel-size): one model's layers split across N ranks, as
Megatron-LM splits them. Each rank holds its share of the attention heads (q, k and v by rows,
o_proj by columns) and of the MLP's inner width (gate and up by rows, down by columns); the two
projections back to the hidden size end in a sum across ranks, so every rank holds the whole
hidden state between layers. Embeddings, norms and the LM head are whole on every rank.

This module says what a rank holds: its model's shape (`shard_config`), its slice of each
checkpoint tensor (`checkpoint_shard`), and the sum across ranks (`RankGroup`). The processes
that run the ranks are engine/tensor_parallel_workers.py's.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import uuid
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from engine import shared_memory_sum
from engine.model_config import ModelConfig
from engine.models import MODEL_REGISTRY
from engine.models.llama import LlamaForCausalLM

# A step's sum waits on the slowest rank's layer; a rank that died closes its connection before this.
REDUCE_TIMEOUT = datetime.timedelta(minutes=5)
SHARED_DIR = "/dev/shm"
SUMS_FILE_KEY = "shared-memory-sums"


def check_shardable(config: ModelConfig, size: int, device: str) -> None:
    """ValueError naming why `config`'s model cannot be split `size` ways on `device`."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if not device.startswith("cpu"):
        raise ValueError("tensor parallelism runs on the CPU only so far (its ranks share one host's KV pool)")
    if MODEL_REGISTRY.get(config.architecture) is not LlamaForCausalLM:
        raise ValueError(f"tensor parallelism serves the Llama family's dense models (Llama, Mistral, Qwen2, Qwen3, "
                         f"SmolLM3, Ministral 3) so far, not {config.architecture}")
    unsupported = [what for what, present in (
        ("experts (MoE)", any(config.moe.is_sparse(i) for i in range(config.num_layers))),
        ("q/k norms over whole projections", config.qk_norm == "projection"),
        ("an image encoder", config.vision is not None),
        ("multimodal checkpoints", config.multimodal is not None),
        ("encoders", config.encoder is not None),
    ) if present]
    if unsupported:
        raise ValueError(f"tensor parallelism does not split models with {', '.join(unsupported)} yet")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(config, name) % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {name} ({getattr(config, name)})")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model one rank of `size` runs: its share of the heads and of the MLP's width."""
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size)


def checkpoint_shard(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of checkpoint tensor `name` of the whole model `config`: a slice of its rows
    (q, k, v, gate, up, sinks) or columns (o, down), or the whole tensor. A bias added after the sum
    across ranks is rank 0's alone (the others' zeros), or it would be added `size` times."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or size == 1:
        return tensor
    proj = parts[4]
    rows = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size, "sinks": config.num_heads,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    if proj in rows:
        share = rows[proj] // size
        return tensor.narrow(0, rank * share, share)
    if proj in ("o_proj", "down_proj"):
        if parts[-1] == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        share = tensor.shape[1] // size
        return tensor.narrow(1, rank * share, share)
    return tensor


def checkpoint_shards(tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, rank: int, size: int
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, checkpoint_shard(name, tensor, config, rank, size)


class RankGroup:
    """The ranks of one model on this host: `all_reduce` sums a tensor across them, through shared memory
    (engine/shared_memory_sum.py) where it fits and the CPU allows, else gloo's over TCP. `check_peers`
    raises when a rank the sums wait for is gone."""

    def __init__(self, rank: int, size: int, store_port: int, store: dist.TCPStore | None = None,
                 check_peers: Callable[[], None] = lambda: None) -> None:
        self.rank, self.size = rank, size
        # Rank 0 made the store (`listening_store`); the others reach it by its port.
        self._store = store or dist.TCPStore("127.0.0.1", store_port, size, False, timeout=REDUCE_TIMEOUT)
        self._shared_sum = None
        if shared_memory_sum.is_supported():
            if rank == 0:
                path = os.path.join(SHARED_DIR, f"baton-rank-sums-{os.getpid()}-{uuid.uuid4().hex[:12]}")
                self._store.set(SUMS_FILE_KEY, path)
            path = self._store.get(SUMS_FILE_KEY).decode()
            self._shared_sum = shared_memory_sum.SharedMemorySum(path, rank, size, check_peers)
        try:
            self._group = dist.ProcessGroupGloo(self._store, rank, size, REDUCE_TIMEOUT)
        finally:
            # Every rank has joined (or it failed): each has mapped the sums' file, whose name is not needed.
            if self._shared_sum is not None and rank == 0:
                os.unlink(path)

    def close(self) -> None:
        """Lets go of gloo's group now: left to the interpreter's teardown, its threads can abort the process."""
        self._group = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed across the ranks, in place."""
        if self._shared_sum is not None and self._shared_sum.fits(tensor) and tensor.is_contiguous():
            return self._shared_sum(tensor)
        self._group.allreduce([tensor]).wait()
        return tensor


def listening_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous, on a free port of this host, for `size` ranks."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=REDUCE_TIMEOUT, wait_for_workers=False)
