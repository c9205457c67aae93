"""Rotary position embeddings (the rotate-half pairing of HF Llama), with scaling, over whole heads
or (Phi-4-mini's partial_rotary_factor) over the first dimensions of each."""
from __future__ import annotations

import math

import torch

from engine.rope_config import SUPPORTED_ROPE_TYPES, uses_long_factors, yarn_temperature


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], after the configured scaling. `head_dim`: the rotated
    dimensions of a head; `max_positions`: the context they serve (LongRoPE's choice of factors)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "longrope":
        return 1.0 / (_longrope_factors(scaling, max_positions) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if rope_type == "proportional":  # (LFM3's full layers): the first part of the frequencies turn, the rest not
        inv_freq[int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2):] = 0.0
        return inv_freq / float(scaling.get("factor", 1.0))
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # YaRN (arXiv 2309.00071): dimensions that turn more than beta_fast times over the original
    # context keep their frequency, those turning fewer than beta_slow times are divided by
    # `factor`, and a linear ramp over the dimensions between blends the two.
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def dim_turning(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(float(scaling.get("beta_fast") or 32)), dim_turning(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _longrope_factors(scaling: dict, max_positions: int | None) -> torch.Tensor:
    # LongRoPE (Phi-3, Phi-4): each frequency divided by a factor of its own, from the set for the context served.
    is_long = uses_long_factors(scaling, max_positions)
    return torch.tensor(scaling["long_factor" if is_long else "short_factor"], dtype=torch.float32)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature (its `attention_factor`, else
    0.1 ln(factor) + 1, or DeepSeek's ratio of that by `mscale` and `mscale_all_dim`), LongRoPE's
    (its `attention_factor`, else sqrt(1 + ln(factor) / ln(original context))); 1 otherwise."""
    rope_type = (scaling or {}).get("rope_type")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if rope_type == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_temperature(factor, float(mscale)) / yarn_temperature(factor, float(mscale_all_dim))
    return yarn_temperature(factor)


def build_rope_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim], in float32, scaled by `rope_attention_factor`. `head_dim`:
    the rotated dimensions of a head (fewer than it has, under a partial_rotary_factor)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    factor = rope_attention_factor(scaling)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def pairs_half_apart(rotary_dim: int) -> torch.Tensor:
    """The order of a head's first `rotary_dim` dimensions that turns RoPE pairs stored side by side
    (2i, 2i + 1: the complex rotation of DeepSeek's and Llama 4's weights) into the pairs half a part
    apart (i, i + rotary_dim / 2) that the kernels turn, by the same angle: the even ones, then the odd."""
    return torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))


def apply_rope_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, Hq, D], k: [T, Hkv, D]; cos, sin: [T, R] already gathered at the positions, R ≤ D:
    # the first R dimensions of each head are rotated (pairs R / 2 apart), the rest pass as they are.
    # q and k are rotated in one pass over [T, Hq + Hkv, D]: half the small ops.
    qk = torch.cat((q, k), dim=1)
    rotary_dim = cos.shape[-1]
    turning = qk[..., :rotary_dim] if rotary_dim < qk.shape[-1] else qk
    half = rotary_dim // 2
    rotated = torch.cat((-turning[..., half:], turning[..., :half]), dim=-1)
    turned = turning * cos.unsqueeze(1).to(q.dtype) + rotated * sin.unsqueeze(1).to(q.dtype)
    if turning is not qk:
        turned = torch.cat((turned, qk[..., rotary_dim:]), dim=-1)
    return turned.split((q.shape[1], k.shape[1]), dim=1)


def mrope_kinds(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Multimodal RoPE's: which of a token's positions (0 time, 1 height, 2 width) turns each of a head's
    dimensions [2 x sum(section)]: the sections in turn (Qwen2.5-VL's), or interleaved, time, height, width, time,
    ... while each lasts, time after (Qwen3-VL's); both halves of a head alike."""
    num = sum(section)
    if interleaved:
        kinds = torch.zeros(num, dtype=torch.int64)
        for kind in (1, 2):
            kinds[kind:section[kind] * 3:3] = kind
    else:
        kinds = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    return torch.cat([kinds, kinds])
