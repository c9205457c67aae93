"""torch's dtype for each name an EngineConfig (or a model's config.json) gives one, and for each
KV page dtype."""
from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# --kv-cache-dtype's one-byte choices (engine/config.py KV_CACHE_DTYPES; auto is the compute dtype).
FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# What a page layout names its dtype (torch's name), for every dtype pages may hold.
PAGE_DTYPES: dict[str, torch.dtype] = {**TORCH_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn,
                                       "float8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pages hold: `dtype` (the compute dtype) for auto."""
    return dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPES[kv_cache_dtype]
