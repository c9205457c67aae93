"""RMSNorm, computed in float32 as Hugging Face Llama does."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H]; the variance is taken in float32 whatever the compute dtype.
    if x.dtype == torch.float32:
        # One fused op, bit-identical to the formula below in float32.
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rms_norm_scaled_in_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normed along D and scaled by float32 `weight` (broadcast over x) in float32, then cast back: as
    transformers' Qwen3.5-style norms scale by 1 + weight, whatever the weights' dtype (Qwen4-Exp's)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(x.dtype)
