"""Zyphra's Zamba2 (Zamba2ForCausalLM: Zamba2-1.2B, 2.7B, 7B), read from its config.json as transformers reads it.

Every layer is a Mamba-2 layer (engine/models/mamba2.py, Granite 4.0-H's kind); a "hybrid" layer first runs one of
`num_mem_blocks` shared transformer blocks, in turn, on its input beside the embeddings (twice the hidden size wide),
each application with low-rank adapters of its own on the MLP's gate and up (and q, k and v where
`use_shared_attention_adapter` says), and adds its output, through a projection of the layer's own, to the Mamba-2
layer's input. Only the hybrid layers have pages: each application of a block attends over its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.mamba_config import MAMBA, NORM_AFTER_GATE, PARALLEL, Mamba2Layout, json_number

ZAMBA2 = "Zamba2ForCausalLM"
# Its layer kinds, by transformers' names now and as released: a hybrid layer holds pages and a Mamba-2 state both.
KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "hybrid": PARALLEL}


@dataclass(frozen=True)
class SharedBlocks:
    num_blocks: int  # the shared blocks, used by the hybrid layers in turn
    hybrid_layers: tuple[int, ...]
    adapter_rank: int  # each application's adapters' rank (its MLP's always; q's, k's and v's too where they are)
    adapts_attention: bool  # adapters on q, k and v too (use_shared_attention_adapter)

    def block_of(self, layer: int) -> int:
        return self.hybrid_layers.index(layer) % self.num_blocks


def zamba2_keys(cfg: dict) -> dict:
    """`cfg` with transformers' Zamba2Config defaults for what it leaves out and its attention's sizes, by the names
    Baton reads: the attention reads the layer's input beside the embeddings, twice the hidden size, in heads of
    2 x hidden / heads."""
    hidden, heads = int(cfg.get("hidden_size", 2560)), int(cfg.get("num_attention_heads", 32))
    return {**cfg, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("attention_head_dim") or 2 * hidden // heads),
            "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden),
            "hidden_act": cfg.get("hidden_act", "gelu"), "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
            "mlp_bias": bool(cfg.get("add_bias_linear", False))}


def read_zamba2(cfg: dict) -> tuple[Mamba2Layout, SharedBlocks]:
    """`cfg` as zamba2_keys gives it. ValueError for layer kinds it has not, a model without hybrid layers, or
    adapters on k and v narrower than q (transformers' adapters are as wide as the attention's input)."""
    num_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    given = cfg.get("layers_block_type") or cfg.get("layer_types")
    if given is None:  # transformers' default: Zamba2-2.7B's
        given = ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3 + \
            ["hybrid"] + ["mamba"] * 2
    unknown = sorted(set(given) - set(KINDS))
    if unknown or len(given) != num_layers:
        raise ValueError(f"layers_block_type must name a Mamba-2 or hybrid layer for each of {num_layers} layers, "
                         f"got {unknown or len(given)}")
    kinds = tuple(KINDS[kind] for kind in given)
    if PARALLEL not in kinds:
        raise ValueError("a Zamba2 model without hybrid layers is not supported (its pages would hold nothing)")
    num_heads = int(cfg.get("n_mamba_heads", 8))
    intermediate = int(cfg.get("mamba_expand", 2)) * hidden
    if intermediate % num_heads:
        raise ValueError(f"n_mamba_heads {num_heads} must divide mamba_expand x hidden_size ({intermediate})")
    num_groups = int(cfg.get("mamba_ngroups", 1))
    if num_heads % num_groups:
        raise ValueError(f"mamba_ngroups {num_groups} must divide n_mamba_heads {num_heads}")
    adapts_attention = bool(cfg.get("use_shared_attention_adapter", False))
    if adapts_attention and int(cfg["num_key_value_heads"]) != int(cfg["num_attention_heads"]):
        raise ValueError("Zamba2's adapters need as many k and v heads as q heads")
    # (its scans clamp a prompt's steps from below by time_step_min, as Nemotron-H's; its gated norm's eps is 1e-5)
    layout = Mamba2Layout(kinds, num_heads, intermediate // num_heads, int(cfg.get("mamba_d_state", 64)), num_groups,
                          int(cfg.get("mamba_d_conv", 4)), bool(cfg.get("use_conv_bias", True)),
                          bool(cfg.get("add_bias_linear", False)),
                          (json_number(cfg.get("time_step_min", 0.001)), float("inf")), gated_norm=NORM_AFTER_GATE,
                          norm_eps=1e-5)
    hybrid_layers = tuple(i for i, kind in enumerate(kinds) if kind == PARALLEL)
    # transformers ties the blocks' repeats only where it ties the embeddings to the LM head: untied, each hybrid
    # layer runs a block of its own (its checkpoint holds each).
    num_blocks = int(cfg.get("num_mem_blocks", 1)) if cfg.get("tie_word_embeddings", True) else len(hybrid_layers)
    shared = SharedBlocks(num_blocks, hybrid_layers, int(cfg.get("adapter_rank", 128)), adapts_attention)
    return layout, shared
