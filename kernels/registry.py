"""Picks the implementation of each kernel once, at start-up.

The model calls kernels only through a `Kernels` bundle, so a faster
implementation can sit beside each torch reference without the model changing.
`BATON_KERNELS=torch` forces the references (for debugging and parity checks).
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

from kernels.attention import decode_attention_torch, prefill_attention_torch
from kernels.kv_cache import write_kv_torch
from kernels.linear import linear_cpu, linear_torch
from kernels.rms_norm import rms_norm_torch
from kernels.rotary import apply_rope_torch

BACKENDS = ("auto", "torch", "cpu")


class Kernels(NamedTuple):
    name: str
    rms_norm: Callable
    apply_rope: Callable
    write_kv: Callable
    prefill_attention: Callable
    decode_attention: Callable
    linear: Callable


TORCH_REFERENCE = Kernels(
    name="torch",
    rms_norm=rms_norm_torch,
    apply_rope=apply_rope_torch,
    write_kv=write_kv_torch,
    prefill_attention=prefill_attention_torch,
    decode_attention=decode_attention_torch,
    linear=linear_torch,
)


def _cpu_kernels() -> Kernels | None:
    from kernels.cpu_decode_attention import decode_attention_cpu, load_library

    if load_library() is None:
        return None
    return TORCH_REFERENCE._replace(name="cpu", decode_attention=decode_attention_cpu, linear=linear_cpu)


def select_kernels(device: str, backend: str | None = None) -> Kernels:
    """The kernel bundle for `device`: the C decode kernel and the thin-batch linear on CPUs where
    the kernel builds, the torch reference everywhere else."""
    backend = backend or os.environ.get("BATON_KERNELS", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; available: {', '.join(BACKENDS)}")
    if backend == "torch" or not device.startswith("cpu"):
        if backend == "cpu":
            raise ValueError(f"the cpu kernel backend cannot run on {device!r}")
        return TORCH_REFERENCE
    kernels = _cpu_kernels()
    if kernels is None and backend == "cpu":
        raise RuntimeError("the cpu kernel backend was asked for but its C kernel could not be built")
    return kernels or TORCH_REFERENCE
