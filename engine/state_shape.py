"""The size of what a hybrid model's sequence keeps in place of KV for its recurrent layers (Gated DeltaNet's and
KDA's, engine/linear_attention_config.py; Mamba-2's, engine/mamba_config.py; Mamba-1's, engine/mamba1_config.py;
LFM2's convolutions, engine/short_conv_config.py): engine/recurrent_state.py lays it in pages."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StateShape:
    """One sequence's states: for each of its layers that keep one, its convolution's last inputs [C, K-1] and its
    recurrent matrix a head [H, Dk, Dv] (Gated DeltaNet's a value head, key by value; Mamba-2's a head, its width
    by the state's size), float32 (as transformers keeps them)."""

    num_layers: int
    conv_dim: int
    conv_width: int
    num_heads: int
    key_dim: int
    value_dim: int
    # After them, for each of `side_layers` (Qwen4-Exp's per-layer n-gram embeddings), a convolution's last inputs
    # [side_conv_dim, side_conv_width] and the sequence's last `side_tokens` token ids.
    side_layers: int = 0
    side_conv_dim: int = 0
    side_conv_width: int = 0
    side_tokens: int = 0

    @property
    def conv_floats(self) -> int:
        return self.conv_dim * self.conv_width

    @property
    def layer_floats(self) -> int:
        return self.conv_floats + self.num_heads * self.key_dim * self.value_dim

    @property
    def side_floats(self) -> int:
        return self.side_conv_dim * self.side_conv_width + self.side_tokens

    @property
    def nbytes(self) -> int:
        return (self.num_layers * self.layer_floats + self.side_layers * self.side_floats) * 4

    def num_pages(self, page_bytes: int) -> int:
        return math.ceil(self.nbytes / page_bytes)
