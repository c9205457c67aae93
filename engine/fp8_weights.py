"""Checkpoints whose linear weights are stored in FP8 (e4m3) with scales beside them, in the two
layouts FP8 models are released in:

- block scales (config.json's `quantization_config`: `quant_method` "fp8", `weight_block_size`),
  as DeepSeek-V3's, Qwen3's and GLM-4.5's FP8 releases: `<name>_scale_inv`, one per block;
- compressed-tensors (`quant_method` "compressed-tensors", `format` "float-quantized"), as
  llm-compressor's "FP8" and "FP8-dynamic" models: `<name>_scale`, one per output channel or per
  tensor, activations quantized dynamically (by vLLM; here they are not quantized at all).

Every such weight is dequantized to the compute dtype as it loads, so the model computes as it would
from the dequantized checkpoint, in that dtype's memory rather than FP8's.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Weights:
    scale_suffix: str  # a weight's scales are the tensor named it plus this
    block: tuple[int, int] | None  # the (rows, columns) each scale covers; None: a channel or the whole tensor


def fp8_weights(config: dict) -> Fp8Weights | None:
    """How the checkpoint's FP8 weights are scaled; None for one not quantized. ValueError for a
    quantization Baton does not load."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method in ("mxfp4", "gptq", "awq", "bitnet") or quantization.get("format") == "pack-quantized":
        return None  # not FP8: engine/mxfp4_weights.py, engine/int4_weights.py, engine/bitnet_weights.py
    if method == "fp8":
        block = quantization.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
            raise ValueError(f"FP8 without weight_block_size [rows, columns] (got {block!r}) is not supported")
        if quantization.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"FP8 activation_scheme {quantization['activation_scheme']!r} is not supported "
                             f"(dynamic is)")
        return Fp8Weights("_scale_inv", (block[0], block[1]))
    if method == "compressed-tensors":
        _check_compressed_tensors(quantization)
        return Fp8Weights("_scale", None)
    raise ValueError(f"quantization {method!r} is not supported (FP8 weights, with block scales or as "
                     f"compressed-tensors, MXFP4 ones, 4-bit GPTQ and AWQ ones, compressed-tensors' "
                     f"pack-quantized integer ones and BitNet's ternary ones are)")


def _check_compressed_tensors(quantization: dict) -> None:
    if quantization.get("format") != "float-quantized":
        raise ValueError(f"compressed-tensors format {quantization.get('format')!r} is not supported "
                         f"(float-quantized FP8 and pack-quantized integers are)")
    if quantization.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme (an FP8 KV cache) is not supported")
    for name, group in (quantization.get("config_groups") or {}).items():
        weights, activations = group.get("weights") or {}, group.get("input_activations")
        if (weights.get("num_bits"), weights.get("type")) != (8, "float") or \
                weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
            raise ValueError(f"compressed-tensors group {name!r}: only 8-bit float weights with a scale per channel "
                             f"or per tensor are supported, got {weights}")
        if activations is not None and not activations.get("dynamic"):
            raise ValueError(f"compressed-tensors group {name!r}: static activation scales are not supported")


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], scales: dict[str, torch.Tensor],
                layout: Fp8Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, each FP8 weight with scales in `scales` (by their name) dequantized."""
    for name, tensor in tensors:
        scale = scales.get(name + layout.scale_suffix)
        yield name, (tensor if scale is None else dequantize(tensor, scale, layout.block))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """weight [rows, columns] in float32, each block (or channel, or all) of it times its scale."""
    rows, columns = weight.shape
    if block is None:
        if scale.numel() != 1 and tuple(scale.shape) not in ((rows,), (rows, 1)):
            raise ValueError(f"a {rows}x{columns} weight needs one scale or one a row, got {tuple(scale.shape)}")
        return weight.float() * scale.float().reshape(-1, 1)
    block_rows, block_columns = block
    expected = (-(-rows // block_rows), -(-columns // block_columns))
    if tuple(scale.shape) != expected:
        raise ValueError(f"a {rows}x{columns} weight in {block_rows}x{block_columns} blocks needs scales of shape "
                         f"{expected}, got {tuple(scale.shape)}")
    scales = scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)[:, :columns]
    return weight.float() * scales
