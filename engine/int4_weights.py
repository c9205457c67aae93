"""4-bit GPTQ and AWQ weights (config.json's `quantization_config` `quant_method` "gptq" or "awq"),
as most quantized Llama and Qwen checkpoints are released. A quantized linear layer `<name>` stores,
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
_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # where each natural column sits among a packed eight's nibbles


@dataclass(frozen=True)
class Int4Weights:
    method: str  # "gptq" or "awq"
    group_size: int  # input rows a scale and zero point cover; -1: all of them
    zeros_offset: int  # added to the stored zero points (GPTQ's first format stores them one less)


def int4_weights(config: dict) -> Int4Weights | None:
    """How the checkpoint's 4-bit weights are stored; None for one not GPTQ or AWQ. ValueError for a
    variant Baton does not load."""
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method")
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


def packed_names(names: list[str], stored: set[str] | dict) -> list[str]:
    """Those of `names` (`<layer>.weight`) stored as 4-bit `qweight`, `qzeros` and `scales`."""
    return [n for n in names if n.endswith(WEIGHT) and n not in stored
            and n.removesuffix(WEIGHT) + QWEIGHT in stored]


def stored_parts(name: str, method: str, stored: set[str] | dict) -> list[str]:
    """What a packed `name` (`<layer>.weight`) is read from beside its qweight."""
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


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], parts: dict[str, torch.Tensor],
                layout: Int4Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, each `<layer>.qweight` (its zeros, scales and g_idx in `parts`) given as `<layer>.weight`,
    dequantized."""
    for name, tensor in tensors:
        if name.endswith(QWEIGHT):
            base = name.removesuffix(QWEIGHT)
            yield base + WEIGHT, dequantize(tensor, parts[base + QZEROS], parts[base + SCALES],
                                            parts.get(base + G_IDX), layout)
        else:
            yield name, tensor
