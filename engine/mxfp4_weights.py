"""MXFP4 weights (config.json's `quantization_config` `quant_method: "mxfp4"`), as gpt-oss is released:
a quantized tensor `<name>` is stored as `<name>_blocks` [..., out, groups, 16] (uint8, two 4-bit e2m1
numbers a byte, the low nibble first) and `<name>_scales` [..., out, groups] (uint8, a power of two
biased by 127 for each group of 32 numbers). Each is dequantized as it loads, to the layout the
unquantized checkpoint stores ([..., in, out]), so the model computes as from that checkpoint, in
the compute dtype's memory rather than MXFP4's.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

# The sixteen e2m1 codes' values: the sign in the high bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(config: dict) -> bool:
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def packed_names(names: list[str], stored: set[str] | dict) -> list[str]:
    """Those of `names` stored as MXFP4 blocks and scales rather than as themselves."""
    return [n for n in names if n not in stored and n + BLOCKS in stored and n + SCALES in stored]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., out, groups, 16] uint8, scales [..., out, groups] uint8 → [..., in, out] float32,
    in = groups * 32."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]  # [..., out, groups, 16] each
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., out, groups, 32]: low nibble first
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(-1, -2)


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]],
                scales: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, each `<name>_blocks` (with `<name>_scales` in `scales`) given as `<name>`, dequantized."""
    for name, tensor in tensors:
        if name.endswith(BLOCKS):
            base = name.removesuffix(BLOCKS)
            yield base, dequantize_mxfp4(tensor, scales[base + SCALES])
        else:
            yield name, tensor
