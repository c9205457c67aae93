"""The C decode-attention kernel for CPUs (kernels/cpu/), built on first use.

It is compiled with the system C compiler into a per-machine cache and called
through ctypes, so no build step or torch headers are needed. Where no
compiler is found the torch reference is used instead (see registry.py).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.attention import decode_attention_torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "paged_decode_attention.c"
# Fast math lets the compiler vectorize the dot products and call glibc's
# vector expf; the kernel never sees inf or NaN (scores are finite dot products).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]


def _cache_dir() -> Path:
    return Path(os.environ.get("BATON_KERNEL_CACHE", Path.home() / ".cache" / "baton" / "kernels"))


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, building it if this machine has none yet; None without a compiler."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: decode attention uses the torch reference")
        return None
    source = SOURCE.read_bytes()
    built_for = " ".join(CFLAGS).encode() + platform.machine().encode() + _cpu_flags()
    key = hashlib.sha256(source + built_for).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_attention-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building %s failed, using the torch reference:\n%s", SOURCE.name, result.stderr)
                return None
            os.replace(built, target)  # atomic: concurrent builders never see half a library
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
        ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_int,
    ]
    return lib


def _cpu_flags() -> bytes:
    # -march=native code must not be reused on a CPU with other instruction sets.
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    head_parts: int = 1,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `decode_attention_torch`; float32 (pages too) on CPU without soft-capping, chunks, sinks,
    ALiBi or heads wider than the pages', otherwise it defers to it."""
    lib = load_library()
    if (lib is None or q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu"
            or not k_cache.is_contiguous() or softcap is not None or chunk_size is not None or sinks is not None
            or head_parts != 1 or alibi_slopes is not None):
        return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, softcap,
                                      chunk_size, sinks, head_parts, alibi_slopes)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty_like(q)
    status = lib.paged_decode_attention_f32(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(),
        batch, num_heads, num_kv_heads, num_blocks, block_size, head_dim,
        block_tables.shape[1], scale, sliding_window or 0, torch.get_num_threads(),
    )
    if status != 0:
        return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
    return out
