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
