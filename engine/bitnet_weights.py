"""BitNet b1.58's ternary weights (config.json's `quantization_config` `quant_method` "bitnet"), as transformers
computes them (its integrations/bitnet.py). Each projection of the layers (not the LM head) holds numbers in
{-1, 0, 1} and one scale:
- `linear_class` "bitlinear" (microsoft/bitnet-b1.58-2B-4T as released): `weight` packed four numbers a byte, each
  stored plus 1 in two bits, down the output dimension (byte row i holds rows i, i + R, i + 2R and i + 3R of R =
  out / 4, in its bits 0-1, 2-3, 4-5 and 6-7), and `weight_scale` [1]: the weight is the numbers over it;
- "autobitlinear", "offline": `weight` the numbers (or packed as above), the weight them times `weight_scale`;
- "autobitlinear", "online": `weight` in full precision, made ternary as it loads: round(w / mean|w|) clipped to
  [-1, 1], times mean|w|.
Whichever the class, every projection's input is quantized on the way in: each token's values to 8-bit integers by
its largest magnitude (127 over it), rounded and scaled back (`fake_quantized`). Each weight is dequantized as it
loads, so the model computes in the compute dtype's memory rather than 2 bits'.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

VALUES_PER_BYTE = 4
SCALE = ".weight_scale"


@dataclass(frozen=True)
class BitNetWeights:
    linear_class: str  # "bitlinear" or "autobitlinear"
    online: bool  # full-precision weights, made ternary as they load (autobitlinear's "online" mode)

    @property
    def stores_scales(self) -> bool:
        return not self.online


def bitnet_weights(config: dict) -> BitNetWeights | None:
    """How the checkpoint's ternary weights are stored; None for one not BitNet's. ValueError for a variant Baton does
    not load."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "bitnet":
        return None
    linear_class = quantization.get("linear_class", "bitlinear")
    mode = quantization.get("quantization_mode", "offline")
    if linear_class not in ("bitlinear", "autobitlinear") or mode not in ("offline", "online"):
        raise ValueError(f"BitNet's linear_class {linear_class!r} in mode {mode!r} is not supported (bitlinear "
                         "offline, autobitlinear offline or online)")
    if linear_class == "bitlinear" and mode == "online":
        raise ValueError("BitNet's bitlinear layers are stored quantized (quantization_mode offline)")
    if quantization.get("use_rms_norm"):
        raise ValueError("BitNet's use_rms_norm (a norm inside each quantized projection) is not supported")
    return BitNetWeights(linear_class, mode == "online")


def unpacked(packed: torch.Tensor) -> torch.Tensor:
    """The numbers in {-1, 0, 1} of a packed weight [out / 4, in] (uint8): [out, in] float32."""
    parts = [((packed >> (2 * i)) & 3) for i in range(VALUES_PER_BYTE)]
    return torch.cat(parts).float() - 1.0


def dequantized(weight: torch.Tensor, scale: torch.Tensor | None, bitnet: BitNetWeights, out_features: int
                ) -> torch.Tensor:
    """A projection's weight [out, in] float32 as transformers' layer computes with it (`scale` None: online)."""
    if weight.dtype == torch.uint8:
        if weight.shape[0] * VALUES_PER_BYTE != out_features:
            raise ValueError(f"a packed BitNet weight of {weight.shape[0]} rows holds {weight.shape[0] * 4} "
                             f"numbers a column, not {out_features}")
        weight = unpacked(weight)
    weight = weight.float()
    if bitnet.online:
        step = weight.abs().mean().clamp(min=1e-5)
        return (weight / step).round().clamp(-1, 1) * step
    scale = scale.float().reshape(())
    return weight / scale if bitnet.linear_class == "bitlinear" else weight * scale


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x [T, D] with each token's values rounded to 8-bit integers by its largest magnitude, and scaled back."""
    x32 = x.float()
    scale = 127.0 / x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return ((x32 * scale).round().clamp(-128, 127) / scale).to(x.dtype)
