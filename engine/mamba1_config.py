"""AI21's Jamba (JambaForCausalLM: Jamba 1.5/1.6/1.7 Mini and Large, Jamba Reasoning 3B), read from its config.json:
which layers attend over pages, which are Mamba-1 layers, and what those keep instead.

A Mamba-1 layer keeps no KV a token: a sequence's past is its state, a number per channel and state dimension
(`mamba_expand` x hidden channels, `mamba_d_state` each) that every token decays by exp(dt A) and writes dt x B
into, read by C, and the last `mamba_d_conv - 1` inputs of its short causal convolution (engine/recurrent_state.py
keeps both in the sequence's pages).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.state_shape import StateShape

JAMBA = "JambaForCausalLM"
MAMBA, ATTENTION = "mamba", "attention"


@dataclass(frozen=True)
class Mamba1Layout:
    layer_types: tuple[str, ...]  # MAMBA or ATTENTION, a layer
    channels: int  # the inner width, mamba_expand x hidden_size
    state_size: int
    conv_kernel: int
    dt_rank: int  # the width dt is projected through
    conv_bias: bool
    proj_bias: bool  # on in_proj and out_proj

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == MAMBA)

    @property
    def kv_places(self) -> dict[int, int]:
        """Each attention layer's layer of the pages."""
        attention = (i for i, kind in enumerate(self.layer_types) if kind == ATTENTION)
        return {layer: place for place, layer in enumerate(attention)}

    @property
    def state_shape(self) -> StateShape:
        # The recurrent state as one head of [channels, state_size].
        return StateShape(len(self.mamba_layers), self.channels, self.conv_kernel - 1, 1, self.channels,
                          self.state_size)


def read_jamba(cfg: dict) -> Mamba1Layout:
    """Jamba's layers: attention every `attn_layer_period`-th from `attn_layer_offset`, Mamba-1 elsewhere.
    ValueError for a model of one kind of layer alone."""
    num_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    period, offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
    kinds = tuple(ATTENTION if i % period == offset else MAMBA for i in range(num_layers))
    if ATTENTION not in kinds or MAMBA not in kinds:
        raise ValueError(f"attn_layer_period {period} and attn_layer_offset {offset} leave {num_layers} layers of one "
                         "kind: Jamba needs Mamba and attention layers both")
    dt_rank = cfg.get("mamba_dt_rank", "auto")
    dt_rank = math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank)
    return Mamba1Layout(kinds, int(cfg.get("mamba_expand", 2)) * hidden, int(cfg.get("mamba_d_state", 16)),
                        int(cfg.get("mamba_d_conv", 4)), dt_rank, bool(cfg.get("mamba_conv_bias", True)),
                        bool(cfg.get("mamba_proj_bias", False)))


def jamba_expert_layers(cfg: dict) -> frozenset[int]:
    """The layers whose MLP is experts: every `expert_layer_period`-th from `expert_layer_offset` (where it has
    more than one expert)."""
    if int(cfg.get("num_experts", 16)) <= 1:
        return frozenset()
    period, offset = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
    return frozenset(i for i in range(int(cfg["num_hidden_layers"])) if i % period == offset)
