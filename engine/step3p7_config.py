"""Step-3.7's text model (its Step3p7ForConditionalGeneration's; engine/models/step3p7.py), read from its text_config
as transformers reads it, the released configs' older names included:

- full-attention and sliding-window layers, the sliding ones with a head count of their own
  (`num_sliding_attention_heads`; released: `attention_other_setting`) and a RoPE of their own (theta and part of a
  head turned, by layer type; released: `rope_theta` and `partial_rotary_factors` a layer), the full ones' scaled;
- attention's output weighed by the sigmoid of a projection of the layer's input, a number a head (`gating` true or
  "per-head"; transformers' attention computes no other);
- dense MLPs in the layers `mlp_layer_types` calls dense (released: those not in `moe_layers_enum`; else the first
  three), experts elsewhere: chosen by sigmoid score plus a learnt bias, weighed by the score renormalized and scaled
  by `moe_router_scaling_factor`, beside a shared expert `share_expert_dim` wide;
- each layer's GLUs clamped as its `swiglu_limits` (experts) and `swiglu_limits_shared` (shared expert, dense MLP)
  say: the activated gate from above, up both ways; 0 or none: unclamped.

Released per-layer lists run on over its MTP layers (`num_nextn_predict_layers`); they are cut to the model's.
"""
from __future__ import annotations

from dataclasses import dataclass

STEP3P7 = "Step3p7ForCausalLM"  # Baton's name of the text model inside Step3p7ForConditionalGeneration
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Step3p7TextConfig where text_config leaves a key out.
TEXT_DEFAULTS = {"vocab_size": 128815, "hidden_size": 4096, "intermediate_size": 11264, "num_hidden_layers": 45,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 128000, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 1280, "n_routed_experts": 288, "share_expert_dim": 1280,
                 "tie_word_embeddings": False}
# The released configs' names of transformers' keys (Step3p7TextConfig.attribute_map).
ALIASES = {"num_attention_groups": "num_key_value_heads", "moe_num_experts": "n_routed_experts",
           "num_local_experts": "n_routed_experts", "moe_top_k": "num_experts_per_tok",
           "share_expert_dims": "share_expert_dim", "num_mtp_layers": "num_nextn_predict_layers"}
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared", "rope_theta",
                   "partial_rotary_factors")


@dataclass(frozen=True)
class Step3p7Layout:
    swiglu_limits: tuple[float | None, ...]  # each layer's experts' clamp; None: none
    shared_swiglu_limits: tuple[float | None, ...]  # each layer's shared expert's and dense MLP's


def step3p7_keys(cfg: dict) -> dict:
    """`cfg` (text_config over the wrapper's keys) with transformers' names, its per-layer lists cut to its layers, its
    RoPE by layer type in `rope_parameters` (the full layers' scaled), its MLPs' kinds in `mlp_layer_types` and its
    layers' q heads in `num_attention_heads_per_layer` (Laguna's name of them).
    ValueError for a layout transformers would refuse or compute otherwise."""
    cfg = {**TEXT_DEFAULTS, **{ALIASES.get(key, key): value for key, value in cfg.items()}}
    num_layers = int(cfg["num_hidden_layers"])
    padded = num_layers + int(cfg.get("num_nextn_predict_layers") or 0)
    for key in PER_LAYER_LISTS:
        if isinstance(cfg.get(key), list) and len(cfg[key]) == padded:
            cfg[key] = cfg[key][:num_layers]
    layer_types = cfg.get("layer_types") or [FULL] * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= {FULL, SLIDING}:
        raise ValueError(f"layer_types must name {FULL!r} or {SLIDING!r} for each of {num_layers} layers")
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        chosen = expert_layers(cfg)
        chosen = set(range(3, num_layers)) if chosen is None else chosen
        mlp_types = ["sparse" if i in chosen else "dense" for i in range(num_layers)]
    if len(mlp_types) != num_layers or not set(mlp_types) <= {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of {num_layers} layers")
    cfg.pop("partial_rotary_factor", None)  # each layer type's own, in rope_parameters
    heads = int(cfg["num_attention_heads"])
    sliding_heads = sliding_layer_heads(cfg, heads)
    return {**cfg, "layer_types": layer_types,
            "num_attention_heads_per_layer": [sliding_heads if kind == SLIDING else heads for kind in layer_types],
            "mlp_layer_types": mlp_types, "rope_scaling": None,
            "rope_parameters": _ropes(cfg, layer_types), "hidden_act": "silu",
            "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar") or cfg["head_dim"]}


def expert_layers(cfg: dict) -> set[int] | None:
    """The layers the released config's `moe_layers_enum` (a list, or a string of comma-separated indices) gives
    experts; None where it has none."""
    experts = cfg.get("moe_layers_enum")
    if isinstance(experts, str):
        experts = [item for item in experts.split(",") if item.strip()]
    return None if experts is None else {int(i) for i in experts}


def sliding_layer_heads(cfg: dict, heads: int) -> int:
    """A sliding-window layer's q heads: `num_sliding_attention_heads` (released: `attention_other_setting`'s), else
    `heads`, the full layers'."""
    other = cfg.get("attention_other_setting") or {}
    return int(cfg.get("num_sliding_attention_heads") or other.get("num_attention_heads") or heads)


def _ropes(cfg: dict, layer_types: list[str]) -> dict:
    """Each layer type's RoPE: as transformers 5 saves them, or from the released lists (a type's first layer's)."""
    given = cfg.get("rope_parameters") or {}
    if all(isinstance(given.get(kind), dict) for kind in set(layer_types)):
        return {kind: dict(given[kind]) for kind in set(layer_types)}
    thetas = cfg.get("rope_theta", 10000.0)
    thetas = thetas if isinstance(thetas, list) else [thetas] * len(layer_types)
    factors = cfg.get("partial_rotary_factors")
    ropes = {}
    for kind in set(layer_types):
        first = layer_types.index(kind)
        ropes[kind] = {"rope_type": "default", "rope_theta": float(thetas[first])}
        if factors:
            ropes[kind]["partial_rotary_factor"] = float(factors[first])
    if cfg.get("rope_scaling") and FULL in ropes:
        ropes[FULL].update(cfg["rope_scaling"])
    return ropes


def read_step3p7_layout(cfg: dict) -> Step3p7Layout:
    """`cfg` as step3p7_keys gives it. ValueError for settings Baton does not serve."""
    num_layers = int(cfg["num_hidden_layers"])
    other = cfg.get("attention_other_setting") or {}
    if int(other.get("num_attention_groups", cfg["num_key_value_heads"])) != int(cfg["num_key_value_heads"]):
        # transformers reads the sliding layers' q heads from it alone
        raise ValueError("attention_other_setting's num_attention_groups unlike num_attention_groups is not supported "
                         "(transformers gives every layer the same KV heads)")
    if SLIDING in cfg["layer_types"] and not cfg.get("sliding_window"):
        raise ValueError("sliding_attention layers without a sliding_window are not supported")
    local = cfg["rope_parameters"].get(SLIDING, {})
    if local.get("rope_type", "default") != "default":
        raise ValueError("a scaled RoPE for sliding-window layers is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError("Step-3.7's mlp_bias is not supported (no release sets it)")
    gating = cfg.get("gating", True)
    if gating not in (True, "per-head"):  # transformers' attention breaks on its gate of an element
        raise ValueError(f"gating {gating!r} is not supported: attention's output gated a head at a time only")
    return Step3p7Layout(
        swiglu_limits=_limits(cfg.get("swiglu_limits"), num_layers),
        shared_swiglu_limits=_limits(cfg.get("swiglu_limits_shared"), num_layers))


def _limits(given: list | None, num_layers: int) -> tuple[float | None, ...]:
    if not given:
        return (None,) * num_layers
    if len(given) != num_layers:
        raise ValueError(f"a swiglu limit list needs one limit for each of {num_layers} layers, got {len(given)}")
    return tuple(float(limit) if limit else None for limit in given)
