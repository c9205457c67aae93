"""Liquid AI's LFM2 and LFM3 (Lfm2ForCausalLM, Lfm2MoeForCausalLM, Lfm3ForCausalLM), read from their config.json:
which layers attend over pages and which are short gated convolutions, and what those keep instead.

A convolution layer keeps no KV a token: a sequence's past is the last `conv_L_cache - 1` inputs of its depthwise
causal convolution (its gated inputs, hidden_size channels), kept in the sequence's state pages as a recurrent
layer's states are (engine/recurrent_state.py; no recurrent matrix beside them).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.state_shape import StateShape

LFM2, LFM2_MOE, LFM3 = "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM"
LFM2S = (LFM2, LFM2_MOE, LFM3)
CONV, FULL, SLIDING = "conv", "full_attention", "sliding_attention"  # (LFM3's attention layers of either kind)


@dataclass(frozen=True)
class ShortConvLayout:
    layer_types: tuple[str, ...]  # CONV, FULL or (LFM3's) SLIDING, a layer
    channels: int  # the hidden size
    conv_kernel: int  # conv_L_cache
    conv_bias: bool  # on in_proj, the convolution and out_proj
    # LFM3's: every operator's and MLP's output RMS-normed before the residual takes it; each attention head's output
    # weighed by a sigmoid of the layer's input.
    sandwich_norms: bool = False
    attention_gates: bool = False

    @property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == CONV)

    @property
    def kv_places(self) -> dict[int, int]:
        """Each attention layer's layer of the pages."""
        full = (i for i, kind in enumerate(self.layer_types) if kind != CONV)
        return {layer: place for place, layer in enumerate(full)}

    @property
    def state_shape(self) -> StateShape:
        return StateShape(len(self.conv_layers), self.channels, self.conv_kernel - 1, 0, 0, 0)


def read_short_conv(cfg: dict) -> ShortConvLayout:
    """LFM2's layers (`layer_types`, or an older config's `full_attn_idxs`: attention there, convolutions elsewhere).
    ValueError for other kinds, or a model of one kind alone."""
    num_layers = int(cfg["num_hidden_layers"])
    given = cfg.get("layer_types")
    if given is None:
        full = set(cfg.get("full_attn_idxs") if cfg.get("full_attn_idxs") is not None else range(num_layers))
        given = [FULL if i in full else CONV for i in range(num_layers)]
    unknown = sorted(set(given) - {CONV, FULL, SLIDING})
    if unknown or len(given) != num_layers:
        raise ValueError(f"layer_types must name convolution or attention layers, one a layer of {num_layers}, "
                         f"got {unknown or len(given)}")
    if CONV not in given or set(given) == {CONV}:
        raise ValueError("an LFM2 model of one kind of layer alone is not supported (it needs convolutions and "
                         "attention both)")
    kernel = int(cfg.get("conv_L_cache", 7 if cfg.get("model_type") == "lfm3" else 3))
    if kernel < 2:
        raise ValueError(f"conv_L_cache must be at least 2, got {kernel}")
    is_lfm3 = cfg.get("model_type") == "lfm3"
    return ShortConvLayout(tuple(given), int(cfg["hidden_size"]), kernel, bool(cfg.get("conv_bias", False)),
                           sandwich_norms=is_lfm3 and bool(cfg.get("use_sandwich_norm", True)),
                           attention_gates=is_lfm3 and bool(cfg.get("use_attention_gate", True)))


def lfm2_intermediate_size(cfg: dict) -> int:
    """The MLP's width as LFM2 sizes it: block_ff_dim (or intermediate_size), two thirds of it where
    block_auto_adjust_ff_dim says, times block_ffn_dim_multiplier, rounded up to block_multiple_of."""
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = int(cfg.get("block_multiple_of", 256))
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width
