"""Hybrid models whose layers are mostly Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), read from their
config.json: which layers attend over pages and what the others keep instead.

A linear-attention layer keeps no KV a token: a sequence's whole past is a state of fixed size, a recurrent
matrix a value head (`key_head_dim` x `value_head_dim`) and the last `conv_kernel - 1` inputs of its short
causal convolution. Only the full-attention layers have pages (ModelConfig.num_kv_layers); each sequence's
states live in pages of its own beside them (engine/recurrent_state.py), so they move with its KV.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.layer_kinds import FULL, LINEAR, LinearAndFullLayers
from engine.state_shape import StateShape

QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5 = "Qwen3_5ForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
HYBRID_LINEAR = (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE)
KIMI_LINEAR = "KimiLinearForCausalLM"  # Kimi Delta Attention (engine/models/kimi_linear.py) beside MLA
OLMO_HYBRID = "OlmoHybridForCausalLM"  # Gated DeltaNet layers beside OLMo 3's attention (engine/models/olmo_hybrid.py)


@dataclass(frozen=True)
class LinearAttention(LinearAndFullLayers):
    layer_types: tuple[str, ...]  # LINEAR or FULL, a layer
    num_key_heads: int
    num_value_heads: int  # a multiple of the key heads: each key head serves that many value heads in turn
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head; else Qwen3.5's four
    beta_scale: float = 1.0  # OLMo Hybrid's 2 (allow_neg_eigval): each token's write strength in (0, 2)
    output_norm_eps: float | None = None  # the output norm's own (OLMo Hybrid's 1e-5); None: the model's
    output_gate: str = "silu"  # what gates the normed output by z: SiLU, or a sigmoid (Qwen4-Exp's option)
    # KDA's forget gate (Kimi-Linear's, Ling 3's): its log bounded below by this through a sigmoid (Ling 3's
    # kda_safe_gate); None: -exp(A_log) softplus, unbounded.
    forget_gate_bound: float | None = None

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels convolved: q, k and v side by side."""
        return 2 * self.key_size + self.value_size

    @property
    def state_shape(self) -> StateShape:
        return StateShape(len(self.linear_layers), self.conv_dim, self.conv_kernel - 1, self.num_value_heads,
                          self.key_head_dim, self.value_head_dim)


def read_linear_attention(cfg: dict, arch: str) -> LinearAttention:
    """ValueError for a layout that is not one of full and linear-attention layers, or without full ones."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None:  # transformers' default: every `full_attention_interval`-th layer attends fully
        interval = int(cfg.get("full_attention_interval", 4))
        kinds = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    kinds = tuple(kinds)
    if len(kinds) != num_layers or set(kinds) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must name {LINEAR!r} or {FULL!r} for each of {num_layers} layers, "
                         f"got {list(kinds)}")
    if FULL not in kinds:
        raise ValueError("a model of linear-attention layers alone is not supported (its pages would hold nothing)")
    layout = LinearAttention(
        layer_types=kinds,
        num_key_heads=int(cfg["linear_num_key_heads"]),
        num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        fused_projections=arch == QWEN3_NEXT,
    )
    if layout.num_value_heads % layout.num_key_heads:
        raise ValueError(f"linear_num_value_heads {layout.num_value_heads} must be a multiple of "
                         f"linear_num_key_heads {layout.num_key_heads}")
    if layout.conv_kernel < 2:
        raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {layout.conv_kernel}")
    return layout


# Kimi-Linear's config.json names for settings other models name otherwise (transformers maps them so).
KIMI_LINEAR_KEYS = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
                    "num_expert_group": "n_group", "num_experts": "n_routed_experts",
                    "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts"}


def kimi_linear_keys(cfg: dict) -> dict:
    """`cfg` with Kimi-Linear's own names of its settings read as the usual ones (those given under them win)."""
    return {**{KIMI_LINEAR_KEYS[key]: value for key, value in cfg.items() if key in KIMI_LINEAR_KEYS}, **cfg}


def read_kimi_linear(cfg: dict) -> LinearAttention:
    """Kimi-Linear's layers: `layer_types`, or as released linear_attn_config's `full_attn_layers` and `kda_layers`
    (counted from 1); its KDA heads (as many keys as values, one width)."""
    linear = cfg.get("linear_attn_config") or {}
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None and "full_attn_layers" in linear:
        full = {int(layer) - 1 for layer in linear["full_attn_layers"]}
        kinds = [FULL if i in full else LINEAR for i in range(num_layers)]
    if kinds is None:
        kinds = [FULL if i and i % 4 == 0 else LINEAR for i in range(num_layers)]
    heads = int(linear.get("num_heads", cfg.get("linear_num_heads", 32)))
    head_dim = int(linear.get("head_dim", cfg.get("linear_head_dim", 128)))
    kernel = int(linear.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)))
    return read_linear_attention({"num_hidden_layers": num_layers, "layer_types": kinds, "linear_num_key_heads": heads,
                                  "linear_num_value_heads": heads, "linear_key_head_dim": head_dim,
                                  "linear_value_head_dim": head_dim, "linear_conv_kernel_dim": kernel}, KIMI_LINEAR)


def read_olmo_hybrid(cfg: dict) -> LinearAttention:
    """OLMo Hybrid's layers and Gated DeltaNet heads, with transformers' defaults where config.json leaves them out:
    every fourth layer full (the last at least), as many key and value heads as attention heads, keys 3/4 of the
    hidden size across them, values twice as wide; write strengths up to 2 unless linear_allow_neg_eigval is off."""
    num_layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = [FULL if i % 4 == 3 else LINEAR for i in range(num_layers)]
        if FULL not in kinds:
            kinds[-1] = FULL
    key_heads = int(cfg.get("linear_num_key_heads") or heads)
    key_dim = int(cfg.get("linear_key_head_dim") or int(0.75 * int(cfg["hidden_size"]) / key_heads))
    layout = read_linear_attention({
        "num_hidden_layers": num_layers, "layer_types": kinds, "linear_num_key_heads": key_heads,
        "linear_num_value_heads": int(cfg.get("linear_num_value_heads") or heads), "linear_key_head_dim": key_dim,
        "linear_value_head_dim": int(cfg.get("linear_value_head_dim") or 2 * key_dim),
        "linear_conv_kernel_dim": cfg.get("linear_conv_kernel_dim", 4)}, OLMO_HYBRID)
    return dataclasses.replace(layout, beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0,
                               output_norm_eps=1e-5)
