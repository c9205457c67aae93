"""AI21's Jamba (JambaForCausalLM: Jamba 1.5/1.6/1.7 Mini and Large, Jamba Reasoning 3B), read from its config.json:
which layers attend over pages, which are Mamba-1 layers, and what those keep instead; and the models of Mamba-1
layers alone (MambaForCausalLM: state-spaces' Mamba; FalconMambaForCausalLM: TII's Falcon-Mamba), whose pool keeps one
layer of pages no layer attends over, for the states (ModelConfig.num_kv_layers).

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
MAMBA_LM, FALCON_MAMBA = "MambaForCausalLM", "FalconMambaForCausalLM"
# The width of a pure Mamba model's page heads (one a page): a token's unused page row costs 2 x this many numbers,
# a sequence's states take their bytes' worth of pages.
STATE_PAGE_WIDTH = 64
# How a Mamba-1 layer norms dt (its low rank), B and C: by learnt weights (Jamba's), without (Falcon-Mamba's), or not.
WEIGHTED, WEIGHTLESS, UNNORMED = "weighted", "weightless", "none"
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
    bcdt_norms: str = WEIGHTED
    norm_eps: float | None = None  # those norms' where not the model's rms_norm_eps (Falcon-Mamba's mixer_rms_eps)

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


def mamba_keys(cfg: dict, ties_embeddings: bool = True) -> dict:
    """A pure Mamba (or Mamba-2: `ties_embeddings` False, its default) config.json by the names ModelConfig reads
    (transformers' MambaConfig defaults where it leaves them out): one page head of STATE_PAGE_WIDTH a token, no
    positions to bound the context but the one given."""
    hidden = int(cfg.get("hidden_size", 768))
    return {**cfg, "hidden_size": hidden, "num_attention_heads": 1, "num_key_value_heads": 1,
            "head_dim": STATE_PAGE_WIDTH, "ssm_head_dim": cfg.get("head_dim", 64),  # (Mamba-2's head_dim its heads')
            "intermediate_size": int(cfg.get("intermediate_size") or int(cfg.get("expand", 2)) * hidden),
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
            "max_position_embeddings": int(cfg.get("max_position_embeddings") or 32_768),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", ties_embeddings),
            "vocab_size": int(cfg.get("vocab_size", 50280)), "num_hidden_layers": int(cfg.get("num_hidden_layers", 32))}


def read_mamba(cfg: dict, arch: str) -> Mamba1Layout:
    """A pure Mamba model's layers (`cfg` as mamba_keys gives it), Falcon-Mamba's dt, B and C normed without
    weights."""
    hidden = int(cfg["hidden_size"])
    dt_rank = cfg.get("time_step_rank", "auto")
    dt_rank = math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank)
    falcon = arch == FALCON_MAMBA
    return Mamba1Layout((MAMBA,) * int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"]),
                        int(cfg.get("state_size", 16)), int(cfg.get("conv_kernel", 4)), dt_rank,
                        bool(cfg.get("use_conv_bias", True)), bool(cfg.get("use_bias", False)),
                        bcdt_norms=WEIGHTLESS if falcon else UNNORMED,
                        norm_eps=float(cfg.get("mixer_rms_eps", 1e-6)) if falcon else None)


def jamba_expert_layers(cfg: dict) -> frozenset[int]:
    """The layers whose MLP is experts: every `expert_layer_period`-th from `expert_layer_offset` (where it has
    more than one expert)."""
    if int(cfg.get("num_experts", 16)) <= 1:
        return frozenset()
    period, offset = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
    return frozenset(i for i in range(int(cfg["num_hidden_layers"])) if i % period == offset)
