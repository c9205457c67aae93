"""Google's Gemma 3n text decoder (Gemma3nForCausalLM: Gemma 3n E2B and E4B), read from its config.json: Gemma 4's
layout (engine/gemma4_config.py: its layers' kinds, their KV shared from `num_kv_shared_layers` on, per-layer
embeddings; one head shape for both kinds, each kind's RoPE whole) and what Gemma 3n has besides:

- AltUp: the residual is `altup_num_inputs` streams; before each layer every stream is predicted from all of them (by
  coefficients a token's active stream routes), the layer computes on the active one, and after it every stream is
  corrected by the layer's change to it; the per-layer embeddings join the streams but the active one.
- LAuReL: a low-rank residual beside each layer's attention.
- Activation sparsity: a layer's MLP gate keeps only what lies above its mean plus a multiple of its deviation (the
  normal quantile of `activation_sparsity_pattern`'s value for the layer; 0: all of it).
- Each layer's MLP of its own width (`intermediate_size` a layer).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.gemma4_config import FULL, SLIDING

GEMMA3N = "Gemma3nForCausalLM"
# Gemma3nTextConfig's defaults, where config.json leaves a field out (transformers reads them so).
GEMMA3N_TEXT_DEFAULTS = {"vocab_size": 262_400, "hidden_size": 2048, "intermediate_size": 16_384,
                         "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                         "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32_768,
                         "rms_norm_eps": 1e-6, "sliding_window": 512, "tie_word_embeddings": True,
                         "final_logit_softcapping": 30.0, "vocab_size_per_layer_input": 262_144,
                         "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 15, "laurel_rank": 64,
                         "altup_num_inputs": 4, "altup_active_idx": 0, "altup_correct_scale": True,
                         "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
DEFAULT_THETAS = {SLIDING: 10_000.0, FULL: 1_000_000.0}


@dataclass(frozen=True)
class AltUp:
    streams: int
    active: int  # the stream each layer computes on
    scales_correction: bool  # the corrected active stream scaled by a learnt vector before the per-layer embeddings
    laurel_rank: int
    widths: tuple[int, ...]  # each layer's MLP's
    sparsity: tuple[float, ...]  # each layer's MLP gate's target sparsity; 0: dense


def gemma3n_keys(cfg: dict) -> dict:
    """`cfg` with transformers' defaults for what it leaves out, by the names engine/gemma4_config.py reads: its
    full layers' heads the sliding layers' shape, each kind's RoPE its own default one."""
    cfg = {**GEMMA3N_TEXT_DEFAULTS, **cfg}
    layers = int(cfg["num_hidden_layers"])
    rope = dict(cfg.get("rope_parameters") or {})
    for kind in (SLIDING, FULL):
        rope[kind] = {"rope_type": "default", "rope_theta": DEFAULT_THETAS[kind], **(rope.get(kind) or {})}
    widths = cfg["intermediate_size"]
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
    # (ModelConfig's one intermediate_size the first layer's; each layer's own are AltUp.widths)
    return {**cfg, "layer_types": cfg.get("layer_types") or [FULL if (i + 1) % 5 == 0 else SLIDING
                                                              for i in range(layers)],
            "rope_parameters": rope, "global_head_dim": int(cfg["head_dim"]),
            "num_global_key_value_heads": int(cfg["num_key_value_heads"]), "intermediate_size": widths[0],
            "layer_intermediate_sizes": widths}


def read_altup(cfg: dict) -> AltUp:
    """`cfg` as gemma3n_keys gives it. ValueError for per-layer lists of other lengths."""
    layers = int(cfg["num_hidden_layers"])
    widths = tuple(cfg["layer_intermediate_sizes"])
    sparsity = cfg.get("activation_sparsity_pattern")
    if sparsity is None:  # transformers': the first ten layers' 0.95, where there are more than ten
        sparsity = [0.95] * 10 + [0.0] * (layers - 10) if layers > 10 else [0.0] * layers
    sparsity = tuple(float(s) for s in (sparsity if isinstance(sparsity, list) else [sparsity] * layers))
    if len(widths) != layers or len(sparsity) != layers:
        raise ValueError(f"intermediate_size and activation_sparsity_pattern must give each of the {layers} layers one")
    streams, active = int(cfg["altup_num_inputs"]), int(cfg["altup_active_idx"])
    if not 0 <= active < streams:
        raise ValueError(f"altup_active_idx {active} must name one of altup_num_inputs {streams} streams")
    return AltUp(streams, active, bool(cfg["altup_correct_scale"]), int(cfg["laurel_rank"]), widths, sparsity)
