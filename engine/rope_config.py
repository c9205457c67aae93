"""A config.json's RoPE settings, read as transformers reads them, without torch: the gateway
reads them too (LongRoPE's frequencies, and so the KV, hang on the context a worker serves)."""
from __future__ import annotations

import math

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
# transformers 5 nests a config's RoPE settings by these layer types.
LAYER_TYPES = ("full_attention", "sliding_attention")
PHI3 = "Phi3ForCausalLM"
HUNYUAN, HUNYUAN_MOE = "HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM"  # Hunyuan dense; Hunyuan-A13B
HUNYUANS = (HUNYUAN, HUNYUAN_MOE)
PHIMOE = "PhimoeForCausalLM"  # Phi-3.5-MoE, Phi-mini-MoE: its LongRoPE scales cos and sin by its own mscale


def rope_parameters(cfg: dict, layer_type: str) -> dict:
    """`rope_parameters` for one type of layer, where transformers 5 nests them by type; else as they are."""
    params = cfg.get("rope_parameters") or {}
    if any(t in params for t in LAYER_TYPES):
        return dict(params.get(layer_type) or {})
    return params


def rope_theta(cfg: dict, params: dict) -> float:
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def partial_rotary_factor(cfg: dict, unset: float = 1.0) -> float:
    """The part of each head RoPE turns: 1, or Phi-4-mini's 0.75 (top level, or in `rope_parameters`);
    `unset` where the config gives none (GLM-4.5's 0.5, transformers' default for it)."""
    params = rope_parameters(cfg, "full_attention")
    return float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor")) or unset)


def rope_scaling(cfg: dict, arch: str) -> dict | None:
    """The full-attention layers' RoPE scaling with the fields transformers fills in filled in;
    None when unscaled. ValueError for a kind Baton does not compute."""
    # transformers 5 writes `rope_parameters`; older configs `rope_scaling` with "type" or "rope_type".
    scaling = cfg.get("rope_scaling") or rope_parameters(cfg, "full_attention") or None
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if ntk_alpha(cfg, arch) is not None:  # only a longer theta (rope_theta_of)
        return None
    # Early Phi-3 configs name LongRoPE "su" or "yarn"; transformers reads both as longrope there.
    if rope_type == "su" or (rope_type == "yarn" and arch == PHI3):
        rope_type = "longrope"
    if rope_type == "mrope":  # Qwen2.5-VL's older configs: its sections are `mrope_section`'s, its frequencies default
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        # The pretraining context: where transformers takes it from (a top-level field wins, as Phi-3 writes it).
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or cfg.get("max_position_embeddings", 2048)
    if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:  # DeepSeek's, Phi-3's: the contexts' ratio
        scaling["factor"] = cfg.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
    if arch == PHIMOE and rope_type == "longrope" and {"short_mscale", "long_mscale"} & set(scaling):
        # transformers multiplies cos and sin by the one of the context it runs in; Baton's are the same at any length.
        mscales = {float(scaling.get(key, 1.0)) for key in ("short_mscale", "long_mscale")}
        if len(mscales) > 1:
            raise ValueError(f"short_mscale {scaling.get('short_mscale')} and long_mscale {scaling.get('long_mscale')} "
                             "differ: Baton's LongRoPE scales by one at any context length")
        scaling["attention_factor"] = mscales.pop()
    return None if rope_type == "default" else scaling


def ntk_alpha(cfg: dict, arch: str) -> float | None:
    """HunYuan's fixed NTK scaling: "dynamic" with an `alpha`, which only stretches the base (transformers reads
    it so for HunYuan alone; a "dynamic" scaling otherwise is refused as any unsupported kind)."""
    if arch not in HUNYUANS:
        return None
    scaling = cfg.get("rope_scaling") or rope_parameters(cfg, "full_attention") or {}
    alpha = scaling.get("alpha")
    if scaling.get("rope_type", scaling.get("type")) != "dynamic" or not alpha:
        return None
    return float(alpha)


def rope_theta_of(cfg: dict, arch: str, head_dim: int) -> float:
    """The full-attention layers' RoPE base: its theta, stretched by an NTK alpha to theta * alpha ** (d / (d - 2))."""
    theta = rope_theta(cfg, rope_parameters(cfg, "full_attention"))
    alpha = ntk_alpha(cfg, arch)
    return theta if alpha is None else theta * alpha ** (head_dim / (head_dim - 2))


def yarn_temperature(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def uses_long_factors(scaling: dict, max_positions: int | None) -> bool:
    """Whether a LongRoPE model serving `max_positions` turns its keys by the long factors: those of
    a context past the pretraining one. transformers switches sets as a sequence grows past it,
    leaving the keys already cached turned by the short set; Baton, as vLLM, picks one set for the
    context it serves, so every key in a cache is turned alike."""
    return max_positions is not None and max_positions > scaling["original_max_position_embeddings"]


def context_dependent_rope(cfg: dict, arch: str, max_model_len: int | None) -> str | None:
    """What of the RoPE, beyond the checkpoint, a worker's KV hangs on: LongRoPE's factor set for
    the context served (`max_model_len`, else the model's); None for every other RoPE."""
    try:
        scaling = rope_scaling(cfg, arch)
    except ValueError:
        return None  # refused where the model loads, with its reason
    if scaling is None or scaling["rope_type"] != "longrope":
        return None
    max_positions = max_model_len or int(cfg.get("max_position_embeddings", 2048))
    return "longrope-long" if uses_long_factors(scaling, max_positions) else "longrope-short"


def mrope_section(cfg: dict) -> tuple[int, ...] | None:
    """Multimodal RoPE's (Qwen2.5-VL's) split of a head's frequencies between a token's time, height and width
    positions, in numbers of frequencies; None for a model with one position a token. (North's full layers have no
    RoPE: its sliding layers' parameters say.)"""
    scaling = _multimodal_rope(cfg)
    section = scaling.get("mrope_section")
    return tuple(int(n) for n in section) if section else None


def mrope_interleaved(cfg: dict) -> bool:
    """Whether multimodal RoPE's sections interleave over a head's frequencies (Qwen3-VL's: time, height, width,
    time, ...) rather than follow one another (Qwen2.5-VL's)."""
    return bool(_multimodal_rope(cfg).get("mrope_interleaved"))


def _multimodal_rope(cfg: dict) -> dict:
    return (cfg.get("rope_scaling") or rope_parameters(cfg, "full_attention")
            or rope_parameters(cfg, "sliding_attention") or {})
