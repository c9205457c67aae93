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
