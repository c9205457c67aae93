"""The page layout both ends of a KV transfer must agree on. Without torch: the gateway reads
layouts too (engine/dtypes.py has torch's dtype for each name)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# bytes per element, by dtype name (the float8 ones: --kv-cache-dtype fp8)
ITEMSIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
SUPPORTED_DTYPES = tuple(ITEMSIZES)


class LayoutMismatchError(ValueError):
    """Pages of one layout (or model) must never be read as another's."""


@dataclass(frozen=True)
class PageLayout:
    """Shape, dtype and model identity of a paged KV pool `[L, 2, Hkv, N, bs, D]`.

    `num_blocks` is the only field two compatible pools may differ in: a prefill
    worker's local pool and a decode worker's pool hold the same pages, not as many.
    """

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", as in common.proto KVLayout
    num_blocks: int
    fingerprint: bytes  # engine.checkpoint.checkpoint_fingerprint: same weights, same KV

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size", "head_dim", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PageLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"PageLayout.dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.fingerprint, bytes):
            raise ValueError(f"PageLayout.fingerprint must be bytes, got {type(self.fingerprint).__name__}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        # [L, 2, Hkv, N, bs, D], as engine/kv_pool.py
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.nbytes // self.num_blocks

    def with_num_blocks(self, num_blocks: int) -> PageLayout:
        return PageLayout(
            self.num_layers, self.num_kv_heads, self.block_size, self.head_dim, self.dtype, num_blocks, self.fingerprint
        )

    def check_compatible(self, other: PageLayout) -> None:
        """Raise LayoutMismatchError naming the first field (other than num_blocks) that differs."""
        for f in fields(self):
            if f.name == "num_blocks":
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                why = ""
                if isinstance(mine, bytes):
                    mine, theirs = mine.hex(), theirs.hex()
                    why = (" (another checkpoint, or a LongRoPE model served with a --max-model-len on the "
                           "other side of its original context)")
                elif f.name == "num_layers":  # an EAGLE head's or MTP layer's KV is in every page past the model's
                    why = (" (an EAGLE head or MTP layer on one side only: prefill and decode workers need the same "
                           "--speculative-config)")
                raise LayoutMismatchError(f"KV layout mismatch in {f.name}: expected {mine!r}, got {theirs!r}{why}")

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, fingerprint: bytes) -> PageLayout:
        """The layout of a pool tensor `[L, 2, Hkv, N, bs, D]`."""
        if tensor.dim() != 6 or tensor.shape[1] != 2:
            raise ValueError(f"a KV pool tensor is [L, 2, Hkv, N, bs, D], got shape {tuple(tensor.shape)}")
        num_layers, _, num_kv_heads, num_blocks, block_size, head_dim = tensor.shape
        dtype = str(tensor.dtype).removeprefix("torch.")
        return cls(num_layers, num_kv_heads, block_size, head_dim, dtype, num_blocks, fingerprint)
