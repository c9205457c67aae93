"""Integer weights: 4-bit GPTQ and AWQ (config.json's `quantization_config` `quant_method` "gptq" or "awq"),
as most quantized Llama and Qwen checkpoints are released, and compressed-tensors' "pack-quantized" format
(llm-compressor's W4A16 and W8A16 exports; Kimi K2's releases). A GPTQ or AWQ linear layer `<name>` stores,
instead of `<name>.weight` [out, in]:
- `qweight` (int32): eight 4-bit numbers each, the lowest bits first. GPTQ packs them down the input
  dimension ([in / 8, out]); AWQ ("gemm") across the output dimension ([in, out / 8]), its columns
  in the order 0, 2, 4, 6, 1, 3, 5, 7 within each eight;
- `qzeros` (int32, [groups, out / 8]): each group's zero point, packed across the output dimension as
  `qweight` is (GPTQ's stored one less than it is, unless `checkpoint_format` is "gptq_v2");
- `scales` (float16, [groups, out]);
- GPTQ's `g_idx` (int32, [in]): the group of each input row (act-order reorders them; without it,
  row // group_size).
GPTQ's exporters also store a `bias` for every packed layer; one the model has none of must be zeros.
A pack-quantized layer stores:
- `weight_packed` (int32, [out, in / (32 / bits)]): each row's numbers along the input dimension, as many a
  word as fit (eight of 4 bits, four of 8), the lowest bits first, each stored plus 2 ** (bits - 1) (the
  numbers are signed);
- `weight_scale` ([out, groups]: a group of `group_size` input columns each; one group for a scale per output
  channel), `weight_shape` ([out, in]);
- asymmetric only, `weight_zero_point` (int32, [out / (32 / bits), groups]): packed as the numbers are, down
  the output dimension; actorder's `weight_g_idx` ([in]): each input column's group.
Each weight is dequantized as it loads, `scale * (q - zero)`, to the [out, in] the unquantized
checkpoint stores, so the model computes as from that checkpoint, in the compute dtype's memory
rather than 4-bit's.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

QWEIGHT, QZEROS, SCALES, G_IDX = ".qweight", ".qzeros", ".scales", ".g_idx"
WEIGHT = ".weight"
# compressed-tensors' pack-quantized layer's, beside `<name>`
PACKED, SCALE, SHAPE, ZERO_POINT, PACKED_G_IDX = "_packed", "_scale", "_shape", "_zero_point", "_g_idx"
PACK_QUANTIZED = "compressed-tensors"
_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # where each natural column sits among a packed eight's nibbles


@dataclass(frozen=True)
class Int4Weights:
    method: str  # "gptq", "awq", or PACK_QUANTIZED (compressed-tensors' pack-quantized)
    group_size: int  # input rows a scale and zero point cover; -1: all of them
    zeros_offset: int  # added to the stored zero points (GPTQ's first format stores them one less)
    bits: int = 4  # pack-quantized's may be 8
    symmetric: bool = False  # pack-quantized's without zero points


def int4_weights(config: dict) -> Int4Weights | None:
    """How the checkpoint's 4-bit weights are stored; None for one not GPTQ or AWQ. ValueError for a
    variant Baton does not load."""
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    if method == PACK_QUANTIZED and quantization.get("format") == "pack-quantized":
        return _pack_quantized(quantization)
    if method not in ("gptq", "awq"):
        return None
    bits = quantization.get("bits", quantization.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} with {bits} bits is not supported (4 is)")
    group_size = int(quantization.get("group_size", quantization.get("q_group_size", 128)))
    if method == "awq":
        if str(quantization.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {quantization.get('version')!r} is not supported (gemm is)")
        if not quantization.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        return Int4Weights("awq", group_size, 0)
    return Int4Weights("gptq", group_size, 0 if quantization.get("checkpoint_format") == "gptq_v2" else 1)


def _pack_quantized(quantization: dict) -> Int4Weights:
    groups = [group.get("weights") or {} for group in (quantization.get("config_groups") or {}).values()]
    if not groups:
        raise ValueError("compressed-tensors pack-quantized without config_groups (how its weights are quantized)")
    if any(weights != groups[0] for weights in groups):
        raise ValueError("compressed-tensors pack-quantized with config groups quantized differently is not supported")
    weights = groups[0]
    if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8) or weights.get("dynamic"):
        raise ValueError(f"compressed-tensors pack-quantized weights of {weights.get('num_bits')}-bit "
                         f"{weights.get('type')} are not supported (4- and 8-bit int ones are)")
    if weights.get("strategy") not in ("group", "channel"):
        raise ValueError(f"compressed-tensors pack-quantized strategy {weights.get('strategy')!r} is not supported "
                         "(group and channel are)")
    if any(group.get("input_activations") for group in quantization["config_groups"].values()):
        raise ValueError("compressed-tensors pack-quantized with quantized activations is not supported "
                         "(weight-only ones are)")
    group_size = int(weights.get("group_size") or -1) if weights["strategy"] == "group" else -1
    return Int4Weights(PACK_QUANTIZED, group_size, 0, int(weights["num_bits"]), bool(weights.get("symmetric", True)))


def packed_name(name: str, method: str) -> str:
    """What a packed `name` (`<layer>.weight`) is stored as: its numbers' name."""
    return name + PACKED if method == PACK_QUANTIZED else name.removesuffix(WEIGHT) + QWEIGHT


def packed_names(names: list[str], stored: set[str] | dict, method: str) -> list[str]:
    """Those of `names` (`<layer>.weight`) stored packed: their numbers beside their scales (and zero points)."""
    return [n for n in names if n.endswith(WEIGHT) and n not in stored and packed_name(n, method) in stored]


def stored_parts(name: str, method: str, stored: set[str] | dict) -> list[str]:
    """What a packed `name` (`<layer>.weight`) is read from beside its numbers."""
    if method == PACK_QUANTIZED:
        optional = [name + part for part in (ZERO_POINT, PACKED_G_IDX) if name + part in stored]
        return [name + SCALE, name + SHAPE, *optional]
    base = name.removesuffix(WEIGHT)
    parts = [base + QZEROS, base + SCALES]
    if method == "gptq" and base + G_IDX in stored:
        parts.append(base + G_IDX)
    return parts


def spare_biases(packed: set[str], names: list[str], stored: set[str] | dict) -> list[str]:
    """The `bias` tensors GPTQ's exporters store for every packed layer, the model's biases or not:
    those the model does not read (which must be zeros)."""
    biases = (n.removesuffix(WEIGHT) + ".bias" for n in packed)
    return [b for b in biases if b in stored and b not in names]


def unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 `packed`, eight 4-bit numbers each (lowest bits first), spread along `dim` (0 or 1): the
    numbers as int32, eight times as many along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 1:
        return nibbles.flatten(-2)
    return nibbles.permute(0, 2, 1).reshape(packed.shape[0] * 8, packed.shape[1])


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               layout: Int4Weights) -> torch.Tensor:
    """The layer's weight, [out, in] float32."""
    if layout.method == "awq":
        q = _awq_order(unpack(qweight, 1))  # [in, out]
    else:
        q = unpack(qweight, 0)  # [in, out]
    zeros = _awq_order(unpack(qzeros, 1)) if layout.method == "awq" else unpack(qzeros, 1)
    zeros = zeros + layout.zeros_offset  # [groups, out]
    num_in = q.shape[0]
    if g_idx is None:
        group = layout.group_size if layout.group_size > 0 else num_in
        g_idx = torch.arange(num_in) // group
    g_idx = g_idx.long()
    weight = (q - zeros[g_idx]).float() * scales.float()[g_idx]  # [in, out]
    return weight.t().contiguous()


def _awq_order(nibbles: torch.Tensor) -> torch.Tensor:
    """AWQ's packed columns back in their natural order."""
    rows, columns = nibbles.shape
    return nibbles.view(rows, columns // 8, 8)[:, :, list(_AWQ_COLUMNS)].reshape(rows, columns)


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, zero_point: torch.Tensor | None,
                      g_idx: torch.Tensor | None, layout: Int4Weights) -> torch.Tensor:
    """A pack-quantized layer's weight, [out, in] float32."""
    num_out, num_in = (int(n) for n in shape)
    numbers = _spread(packed, layout.bits)[:, :num_in]  # [out, in]
    num_groups = scale.shape[-1] if scale.dim() == 2 else 1
    if num_groups == 1:
        g_idx = torch.zeros(num_in, dtype=torch.long)
    elif g_idx is None:
        g_idx = torch.arange(num_in) // layout.group_size
    g_idx = g_idx.long()
    scales = scale.float().reshape(num_out, num_groups)[:, g_idx]
    if zero_point is None:
        return numbers.float() * scales
    zeros = _spread(zero_point.t(), layout.bits).t()[:num_out]  # packed down the output dimension
    return (numbers - zeros.reshape(num_out, num_groups)[:, g_idx]).float() * scales


def _spread(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `packed` [rows, words], each word 32 / bits numbers along the row, lowest bits first, stored offset by
    2 ** (bits - 1): the signed numbers, [rows, words * 32 / bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    numbers = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return numbers.flatten(-2) - (1 << (bits - 1))


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], parts: dict[str, torch.Tensor],
                layout: Int4Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, each packed layer's numbers (`<layer>.qweight`, `<layer>.weight_packed`; its zeros, scales and
    group indices in `parts`) given as `<layer>.weight`, dequantized."""
    for name, tensor in tensors:
        if layout.method == PACK_QUANTIZED and name.endswith(WEIGHT + PACKED):
            weight = name.removesuffix(PACKED)
            yield weight, dequantize_packed(tensor, parts[weight + SCALE], parts[weight + SHAPE],
                                            parts.get(weight + ZERO_POINT), parts.get(weight + PACKED_G_IDX), layout)
        elif name.endswith(QWEIGHT):
            base = name.removesuffix(QWEIGHT)
            yield base + WEIGHT, dequantize(tensor, parts[base + QZEROS], parts[base + SCALES],
                                            parts.get(base + G_IDX), layout)
        else:
            yield name, tensor
