"""ALiBi's slopes (BLOOM's, MPT's: ModelConfig.alibi): each attention head's scores plus its slope times the key's
position, in place of a position embedding, computed as transformers computes them.

BLOOM's: a geometric run from 2^(-8/n) for the nearest power of two n at or under the head count, the heads past it
taking every other slope of the run for 2n. MPT's: 2^(-8k / m), k = 1..m, for the nearest power of two m at or over
the head count, the odd ones first where m is more than the heads."""
from __future__ import annotations

import math

import torch


def alibi_slopes(kind: str, num_heads: int) -> torch.Tensor:
    """[num_heads] float32, by `kind`'s ("bloom" or "mpt") run."""
    return _mpt_slopes(num_heads) if kind == "mpt" else _bloom_slopes(num_heads)


def _bloom_slopes(num_heads: int) -> torch.Tensor:
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32),
                       torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest == num_heads:
        return slopes
    extra = torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32),
                      torch.arange(1, 1 + 2 * min(closest, num_heads - closest), 2, dtype=torch.int32))
    return torch.cat([slopes, extra])


def _mpt_slopes(num_heads: int) -> torch.Tensor:
    padded = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, padded + 1, dtype=torch.int64).float() * (8 / padded))
    if padded == num_heads:
        return slopes
    return torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
