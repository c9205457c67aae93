"""Gemma 4's text decoder (Gemma4ForCausalLM; the text model of Gemma4ForConditionalGeneration), read from its
config.json: what its layers have that ModelConfig's one head size and one KV layer a layer do not say.

- Its full-attention layers' heads are wider than the sliding-window layers' (`global_head_dim`, or
  `per_layer_config`), of their own number of KV heads (`num_global_key_value_heads`), and may take their
  values from the key projection (`attention_k_eq_v`). Every layer's KV lives in pages of one shape: heads
  of the pages' size (the narrower kind's), as many as the widest layer needs; a wider head spans
  `page_parts` of them (kernels/attention.py). A layer needing fewer shares a pool layer's heads with
  the next such layers (two sliding-window layers of E4B's in the heads of one full layer's), so the
  pool holds no more than the layers need.
- Its last `num_kv_shared_layers` layers compute no K or V: each attends over the pages of the last earlier
  layer of its own kind, and takes none of its own; with `use_double_wide_mlp`, their MLPs are twice as wide.
- Per-layer embeddings (`hidden_size_per_layer_input`): a table of a small vector a token for every layer,
  mixed with a projection of the token's embedding and fed into each layer's residual.
- With `enable_moe_block` (26B-A4B), each layer's MLP has experts beside it: a token's top `top_k_experts` of
  `num_experts` by a router of its own (the layer's input RMS-normed, scaled, projected; softmax; the chosen
  renormalized and weighed by a learnt scale an expert), their outputs and the MLP's each normed and summed.
- The full layers' RoPE is "proportional": the first `partial_rotary_factor` of a head's frequencies turn,
  at the head's whole width's rates, the rest stand still.
"""
from __future__ import annotations

from dataclasses import dataclass

GEMMA4 = "Gemma4ForCausalLM"
# Gemma4TextConfig's defaults, where config.json leaves a field out (transformers reads them so).
GEMMA4_TEXT_DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
                        "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
                        "rms_norm_eps": 1e-6, "sliding_window": 512, "tie_word_embeddings": True,
                        "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
                        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
# Gemma 4 unified (Gemma4UnifiedForCausalLM, google/gemma-4-12B-it's text model): Gemma 4's layers without per-layer
# embeddings or experts, read as Gemma 4's with its own defaults.
GEMMA4_UNIFIED = "Gemma4UnifiedForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
DEFAULT_GLOBAL_HEAD_DIM = 512


@dataclass(frozen=True)
class Gemma4Heads:
    """One kind of layer's attention."""

    num_kv_heads: int
    head_dim: int
    values_are_keys: bool  # values from the key projection (attention_k_eq_v's full layers): no v_proj
    page_parts: int  # heads of the pages one of its heads spans
    rope_theta: float
    rope_fraction: float  # of a head's frequencies RoPE turns (proportional RoPE's partial_rotary_factor)
    rope_factor: float  # its frequencies divided by this


@dataclass(frozen=True)
class Gemma4Experts:
    num_experts: int
    top_k: int
    width: int  # moe_intermediate_size


@dataclass(frozen=True)
class Gemma4Layout:
    layer_types: tuple[str, ...]
    sliding: Gemma4Heads
    full: Gemma4Heads
    # Where each layer's KV lies: (pool layer, first of its heads there); a layer sharing KV, where that of the last
    # earlier layer of its kind computing it lies.
    kv_places: tuple[tuple[int, int], ...]
    num_kv_layers: int  # the pool's layers
    first_sharing_layer: int
    double_wide_layers: frozenset[int]  # the KV-sharing layers, where use_double_wide_mlp doubles their MLP
    per_layer_width: int  # hidden_size_per_layer_input; 0: no per-layer embeddings
    per_layer_vocab_size: int
    page_heads: int
    page_head_dim: int
    experts: Gemma4Experts | None = None  # beside every layer's MLP; None: dense
    pad_token_id: int = 0  # whose per-layer embeddings an image's rows take (as transformers' Gemma4Model gives them)

    def heads(self, layer: int) -> Gemma4Heads:
        return self.full if self.layer_types[layer] == FULL else self.sliding

    def computes_kv(self, layer: int) -> bool:
        return layer < self.first_sharing_layer


@dataclass(frozen=True)
class Gemma4Assistant:
    """What joins a Gemma 4 assistant drafter to its target (engine/gemma4_assistant_config.py)."""

    backbone_hidden_size: int  # its target's hidden size
    num_centroids: int  # 0: logits by the LM head over every token
    centroid_top_k: int


def gemma4_unified_keys(cfg: dict) -> dict:
    """Gemma 4 unified's config.json as Gemma 4's: Gemma4UnifiedTextConfig's defaults where they differ (a window of
    1024, a context of 262,144), no per-layer embeddings, no experts."""
    return {**GEMMA4_TEXT_DEFAULTS, "sliding_window": 1024, "max_position_embeddings": 262_144, **cfg,
            "hidden_size_per_layer_input": 0, "enable_moe_block": False}


def read_gemma4_layout(cfg: dict, forces_last_full: bool = True) -> Gemma4Layout:
    """ValueError for what Baton does not compute of it. `forces_last_full`: the last layer full whatever
    layer_types says, as transformers' Gemma 4 makes it (its Gemma 3n does not)."""
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Gemma 4 and 3n (their layers have no biases here)")
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": an image's tokens only
        raise ValueError("use_bidirectional_attention 'all' is not supported (a decoder attends causally)")
    num_layers = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {num_layers} layers, each {SLIDING!r} or {FULL!r}")
    if forces_last_full:
        types[-1] = FULL
    head_dim, kv_heads = int(cfg["head_dim"]), int(cfg["num_key_value_heads"])
    full_dim, full_kv_heads = _full_layer_heads(cfg, types, head_dim, kv_heads)
    values_are_keys = bool(cfg.get("attention_k_eq_v"))
    page_dim = min(head_dim, full_dim)
    if head_dim % page_dim or full_dim % page_dim:
        raise ValueError(f"heads of {head_dim} and {full_dim} dimensions do not share pages (one must divide the "
                         "other)")
    rope = cfg.get("rope_parameters") or DEFAULT_ROPE
    sliding = Gemma4Heads(kv_heads, head_dim, False, head_dim // page_dim,
                          *_rope(rope.get(SLIDING) or DEFAULT_ROPE[SLIDING], SLIDING))
    full = Gemma4Heads(full_kv_heads, full_dim, values_are_keys, full_dim // page_dim,
                       *_rope(rope.get(FULL) or DEFAULT_ROPE[FULL], FULL))
    num_shared = int(cfg.get("num_kv_shared_layers") or 0)
    first_sharing = num_layers - num_shared
    if not 0 < first_sharing <= num_layers:
        raise ValueError(f"num_kv_shared_layers {num_shared} leaves no layer of {num_layers} computing K and V")
    kinds = {SLIDING: sliding, FULL: full}
    needs = [kinds[t].num_kv_heads * kinds[t].page_parts for t in types[:first_sharing]]
    page_heads = max(needs)
    places, used = [], []  # used: the heads taken of each pool layer so far
    for need in needs:  # each into the first pool layer with room for it
        pool_layer = next((i for i, taken in enumerate(used) if taken + need <= page_heads), len(used))
        if pool_layer == len(used):
            used.append(0)
        places.append((pool_layer, used[pool_layer]))
        used[pool_layer] += need
    for layer in range(first_sharing, num_layers):
        sources = [i for i in range(first_sharing) if types[i] == types[layer]]
        if not sources:
            raise ValueError(f"layer {layer} shares the K and V of an earlier {types[layer]} layer, and none computes "
                             "them")
        places.append(places[sources[-1]])
    per_layer_width = int(cfg.get("hidden_size_per_layer_input") or 0)
    return Gemma4Layout(
        layer_types=tuple(types), sliding=sliding, full=full, kv_places=tuple(places), num_kv_layers=len(used),
        first_sharing_layer=first_sharing,
        double_wide_layers=frozenset(range(first_sharing, num_layers)) if cfg.get("use_double_wide_mlp")
        else frozenset(),
        per_layer_width=per_layer_width,
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
        page_heads=page_heads, page_head_dim=page_dim, experts=_experts(cfg),
        pad_token_id=int(cfg.get("pad_token_id") or 0))


def _experts(cfg: dict) -> Gemma4Experts | None:
    if not cfg.get("enable_moe_block"):
        return None
    sizes = ("num_experts", "top_k_experts", "moe_intermediate_size")
    if not all(cfg.get(name) for name in sizes):
        raise ValueError(f"enable_moe_block needs {', '.join(sizes)}")
    experts = Gemma4Experts(*(int(cfg[name]) for name in sizes))
    if not 0 < experts.top_k <= experts.num_experts:
        raise ValueError(f"top_k_experts {experts.top_k} must be from 1 to num_experts {experts.num_experts}")
    return experts


def _full_layer_heads(cfg: dict, types: list[str], head_dim: int, kv_heads: int) -> tuple[int, int]:
    """The full layers' head size and KV heads: `per_layer_config`'s overrides (as transformers saves them), else
    `global_head_dim` and `num_global_key_value_heads` (as Gemma 4 is released)."""
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        # transformers reads num_global_key_value_heads only where attention_k_eq_v is set
        global_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", True) else None
        return int(cfg.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM), int(global_kv or kv_heads)
    by_layer = {int(layer): dict(values) for layer, values in overrides.items()}
    for layer, values in by_layer.items():
        unknown = set(values) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ValueError(f"per_layer_config sets {sorted(unknown)} of layer {layer}; Baton reads head_dim and "
                             "num_key_value_heads there")
    kinds = {t: {(by_layer.get(i, {}).get("head_dim", head_dim),
                  by_layer.get(i, {}).get("num_key_value_heads", kv_heads)) for i, x in enumerate(types) if x == t}
             for t in (SLIDING, FULL)}
    if kinds[SLIDING] - {(head_dim, kv_heads)} or len(kinds[FULL]) > 1:
        raise ValueError("per_layer_config gives layers of one kind different heads; Baton serves one head shape "
                         "for the sliding-window layers and one for the full layers")
    (full,) = kinds[FULL] or {(head_dim, kv_heads)}
    return int(full[0]), int(full[1])


def _rope(params: dict, layer_type: str) -> tuple[float, float, float]:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(f"RoPE {rope_type!r} of the {layer_type} layers is not supported (default or proportional)")
    fraction = float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    factor = float(params.get("factor", 1.0)) if rope_type == "proportional" else 1.0
    return float(params.get("rope_theta", DEFAULT_ROPE[layer_type]["rope_theta"])), fraction, factor
