"""Checkpoints whose linear weights are stored in FP8 (e4m3) with a scale for each block of them, as
DeepSeek-V3, Qwen3's and GLM-4.5's FP8 releases ship them (config.json's `quantization_config`:
`quant_method` "fp8", `weight_block_size`, each weight's `<name>_scale_inv` beside it): every such
weight is dequantized to the compute dtype as it loads, so the model computes as it would from the
dequantized checkpoint, in that dtype's memory rather than FP8's."""
from __future__ import annotations

from collections.abc import Iterator

import torch

SCALE_SUFFIX = "_scale_inv"


def fp8_weight_blocks(config: dict) -> tuple[int, int] | None:
    """The (rows, columns) a weight's scales each cover; None for a checkpoint not quantized.
    ValueError for a quantization Baton does not load."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization {method!r} is not supported (FP8 weights with block scales are)")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
        raise ValueError(f"FP8 without weight_block_size [rows, columns] (got {block!r}) is not supported")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"FP8 activation_scheme {quantization['activation_scheme']!r} is not supported (dynamic is)")
    return block[0], block[1]


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], scales: dict[str, torch.Tensor],
                block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, each FP8 weight with a scale in `scales` (by its `_scale_inv` name) dequantized."""
    for name, tensor in tensors:
        scale = scales.get(name + SCALE_SUFFIX)
        yield name, (tensor if scale is None else dequantize(tensor, scale, block))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [rows, columns] in float32, each block of it times its scale (edge blocks may be partial)."""
    rows, columns = weight.shape
    block_rows, block_columns = block
    expected = (-(-rows // block_rows), -(-columns // block_columns))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"a {rows}x{columns} weight in {block_rows}x{block_columns} blocks needs scales of shape "
                         f"{expected}, got {tuple(scale_inv.shape)}")
    scales = scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)[:, :columns]
    return weight.float() * scales
