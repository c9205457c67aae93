"""The weights a model module declares before its checkpoint fills them."""
from __future__ import annotations

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
