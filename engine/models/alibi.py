"""ALiBi's slopes (BLOOM's, Falcon-RW's): each attention head's scores plus its slope times the key's position, in
place of a position embedding. The slopes are a geometric run from 2^(-8/n) for the nearest power of two n at or
under the head count, the heads past it taking every other slope of the run for 2n (transformers' `_get_alibi_slopes`,
from the paper's code)."""
from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32),
                       torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest == num_heads:
        return slopes
    extra = torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32),
                      torch.arange(1, 1 + 2 * min(closest, num_heads - closest), 2, dtype=torch.int32))
    return torch.cat([slopes, extra])
