"""Picks the implementation of each kernel once, at start-up.

The model calls kernels only through a `Kernels` bundle, so a GPU build can put
its own functions here without the model changing.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from kernels.attention import decode_attention_torch, prefill_attention_torch
from kernels.kv_cache import write_kv_torch
from kernels.rms_norm import rms_norm_torch
from kernels.rotary import apply_rope_torch


class Kernels(NamedTuple):
    name: str
    rms_norm: Callable
    apply_rope: Callable
    write_kv: Callable
    prefill_attention: Callable
    decode_attention: Callable


TORCH_REFERENCE = Kernels(
    name="torch",
    rms_norm=rms_norm_torch,
    apply_rope=apply_rope_torch,
    write_kv=write_kv_torch,
    prefill_attention=prefill_attention_torch,
    decode_attention=decode_attention_torch,
)


def select_kernels(device: str, backend: str = "auto") -> Kernels:
    """The kernel bundle for `device`. Only the torch reference exists so far;
    it runs on every device."""
    if backend not in ("auto", "torch"):
        raise ValueError(f"unknown kernel backend {backend!r}; available: auto, torch")
    return TORCH_REFERENCE
