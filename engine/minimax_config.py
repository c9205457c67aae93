"""MiniMax-Text-01 and MiniMax-M1 as transformers holds them (MiniMaxForCausalLM, the `-hf` checkpoints), read from
config.json: lightning attention layers (kernels/lightning_attention.py) between softmax attention layers by
`layer_types`, Mixtral's experts in every layer, and each block's residual taken after its norm, weighed against its
output by the block kind's alpha and beta factors.

A lightning attention layer keeps no KV a token: a sequence's past is a state a head, [head_dim, head_dim], in its
state pages (engine/recurrent_state.py), with no convolution window.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.layer_kinds import FULL, LINEAR, LinearAndFullLayers
from engine.state_shape import StateShape

MINIMAX = "MiniMaxForCausalLM"
# MiniMax-Text-01 and MiniMax-M1 as released (MiniMaxAI/MiniMax-Text-01, -M1-40k, -M1-80k), for their own modeling
# code: the same layers and tensors, their config.json in keys of its own (engine/model_config_loader.py reads them
# as transformers' MiniMaxConfig's, `minimax_release_keys`).
MINIMAX_RELEASES = ("MiniMaxText01ForCausalLM", "MiniMaxM1ForCausalLM")
RELEASE_FACTORS = {"layernorm_full_attention": "full_attn", "layernorm_linear_attention": "linear_attn",
                   "layernorm_mlp": "mlp"}


@dataclass(frozen=True)
class MiniMaxLayout(LinearAndFullLayers):
    layer_types: tuple[str, ...]  # LINEAR or FULL, a layer
    num_heads: int  # the lightning layers' heads, each head_dim wide
    head_dim: int
    block_size: int  # the tokens a prompt's run takes at a time (its blocks' decays exact whatever it is)
    # A block's output h' = alpha * normed input + beta * its output, by kind: full attention's, lightning's, the MLP's.
    full_factors: tuple[float, float]
    linear_factors: tuple[float, float]
    mlp_factors: tuple[float, float]

    @property
    def state_shape(self) -> StateShape:
        return StateShape(len(self.linear_layers), 0, 0, self.num_heads, self.head_dim, self.head_dim)


def read_minimax(cfg: dict) -> MiniMaxLayout:
    """ValueError for a layout without softmax attention layers (its pages would hold nothing) or of other kinds."""
    num_layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    # transformers' default: every other layer from the first softmax attention
    kinds = tuple(cfg.get("layer_types") or (FULL if (i + 1) % 2 else LINEAR for i in range(num_layers)))
    if len(kinds) != num_layers or set(kinds) - {LINEAR, FULL} or FULL not in kinds:
        raise ValueError(f"layer_types must name {LINEAR!r} or {FULL!r} for each of {num_layers} layers, at least "
                         f"one {FULL!r}, got {list(kinds)}")
    block_size = int(cfg.get("block_size", 256))
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def factors(kind: str) -> tuple[float, float]:
        return float(cfg.get(f"{kind}_alpha_factor", 1)), float(cfg.get(f"{kind}_beta_factor", 1))

    return MiniMaxLayout(layer_types=kinds, num_heads=heads,
                         head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), block_size=block_size,
                         full_factors=factors("full_attn"), linear_factors=factors("linear_attn"),
                         mlp_factors=factors("mlp"))


def minimax_release_keys(cfg: dict) -> dict:
    """A release's config.json as transformers' MiniMaxConfig: `attn_type_list` (0 lightning, 1 softmax) as
    layer_types, `layernorm_*_alpha`/`_beta` as the `*_alpha_factor`/`_beta_factor`, and `rotary_dim` (RoPE turning a
    head's first dimensions, as its modeling code and vLLM turn them) as a part of the head. ValueError for what its
    code computes and transformers' MiniMax does not: the residual before each block's norm (`postnorm` false; the
    releases set it), shared experts beside the routed ones, a number of experts a layer."""
    if not cfg.get("postnorm", False):
        raise ValueError("postnorm false (each block's residual taken before its norm) is not supported; MiniMax's "
                         "releases set it")
    shared = cfg.get("shared_intermediate_size") or 0
    if any(shared) if isinstance(shared, list) else shared:
        raise ValueError("shared_intermediate_size (shared experts beside the routed ones) is not supported")
    if isinstance(cfg.get("num_local_experts"), list):
        raise ValueError("num_local_experts a layer (a list) is not supported; one number of experts for every layer")
    kinds = cfg.get("attn_type_list")
    if kinds is not None and set(kinds) - {0, 1}:
        raise ValueError(f"attn_type_list must hold 0 (lightning attention) or 1 (softmax attention), got {kinds}")
    keys = {key: value for key, value in cfg.items()
            if key not in ("attn_type_list", "postnorm", "rotary_dim", "shared_intermediate_size")
            and not key.startswith(tuple(RELEASE_FACTORS))}
    if kinds is not None:
        keys["layer_types"] = [FULL if kind else LINEAR for kind in kinds]
    for released, factor in RELEASE_FACTORS.items():
        keys |= {f"{factor}_alpha_factor": cfg.get(f"{released}_alpha", 1),
                 f"{factor}_beta_factor": cfg.get(f"{released}_beta", 1)}
    if cfg.get("rotary_dim"):
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        keys["partial_rotary_factor"] = int(cfg["rotary_dim"]) / head_dim
    return keys
