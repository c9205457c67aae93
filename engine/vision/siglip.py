"""SigLIP's vision transformer (Gemma 3's tower), as transformers' SiglipVisionModel computes its
last hidden state: patches by a strided convolution, learnt position embeddings, pre-norm encoder
layers of full attention and a tanh-GELU MLP, a final LayerNorm. (Its pooling head is not read: the
projectors that follow take every patch.)"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.vision_config import VisionConfig

# An EncoderLayer's tensors' names in a checkpoint (its two norms and its attention's output projection): SigLIP's,
# and Llama 4's tower's.
SIGLIP_LAYER_NAMES = ("layer_norm1", "layer_norm2", "self_attn.out_proj")
LLAMA4_LAYER_NAMES = ("input_layernorm", "post_attention_layernorm", "self_attn.o_proj")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# The MLPs' activations, by transformers' names.
ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu,
               "quick_gelu": quick_gelu}


class EncoderLayer(nn.Module):
    """A pre-norm layer of full attention and a GELU MLP, biases everywhere: SigLIP's (GELU's tanh
    approximation); Llama 4's tower's too (exact GELU, its q and k turned by 2D RoPE); Step-3.7's (quick GELU, each
    branch's output scaled by a learnt vector: `layer_scales`)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, activation: str = "gelu_pytorch_tanh",
                 layer_scales: bool = False) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads, self.eps, self.activation = config.num_heads, config.layer_norm_eps, ACTIVATIONS[activation]
        self.scale1 = empty_param(hidden, dtype=dtype) if layer_scales else None
        self.scale2 = empty_param(hidden, dtype=dtype) if layer_scales else None
        self.norm1_weight, self.norm1_bias = empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.norm2_weight, self.norm2_bias = empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.qkv_weight = empty_param(3 * hidden, hidden, dtype=dtype)
        self.qkv_bias = empty_param(3 * hidden, dtype=dtype)
        self.out_weight, self.out_bias = empty_param(hidden, hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.fc1_weight, self.fc1_bias = empty_param(inner, hidden, dtype=dtype), empty_param(inner, dtype=dtype)
        self.fc2_weight, self.fc2_bias = empty_param(hidden, inner, dtype=dtype), empty_param(hidden, dtype=dtype)

    def load_weights(self, tensors: dict[str, torch.Tensor], prefix: str, names: tuple[str, str, str]) -> None:
        """From the checkpoint's names under `prefix`, its norms' and output projection's as `names` give them
        (q, k and v fused as they load)."""
        norm1, norm2, out = names
        stored = {"norm1": norm1, "norm2": norm2, "out": out, "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
        for kind in ("weight", "bias"):
            for ours, name in stored.items():
                put_tensor(getattr(self, f"{ours}_{kind}"), tensors, f"{prefix}{name}.{kind}")
            put_tensor(getattr(self, f"qkv_{kind}"), tensors, *(f"{prefix}self_attn.{x}_proj.{kind}" for x in "qkv"))

    def forward(self, h: torch.Tensor, turned: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:  # h [B, P, hidden]; `turned`: q and k [B, heads, P, dim] as positions turn them
        hidden = h.shape[-1]
        x = F.layer_norm(h, (hidden,), self.norm1_weight, self.norm1_bias, self.eps)
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).unflatten(-1, (3, self.num_heads, -1)).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if turned is not None:
            q, k = turned(q), turned(k)
        attended = F.linear(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2), self.out_weight,
                            self.out_bias)
        h = h + (attended if self.scale1 is None else attended * self.scale1)
        x = F.layer_norm(h, (hidden,), self.norm2_weight, self.norm2_bias, self.eps)
        x = F.linear(self.activation(F.linear(x, self.fc1_weight, self.fc1_bias)), self.fc2_weight, self.fc2_bias)
        return h + (x if self.scale2 is None else x * self.scale2)


class SiglipVisionTower(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.config = config
        self.patch_weight = empty_param(hidden, config.num_channels, patch, patch, dtype=dtype)
        self.patch_bias = empty_param(hidden, dtype=dtype)
        self.positions = empty_param(config.patches_per_side ** 2, hidden, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(config, dtype) for _ in range(config.num_layers))
        self.post_norm_weight, self.post_norm_bias = empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, C, image_size, image_size] (normalized) → each patch's hidden state [B, P, hidden]."""
        patches = F.conv2d(pixels.to(self.patch_weight.dtype), self.patch_weight, self.patch_bias,
                           stride=self.config.patch_size)
        h = patches.flatten(2).transpose(1, 2) + self.positions
        for layer in self.layers:
            h = layer(h)
        return F.layer_norm(h, (h.shape[-1],), self.post_norm_weight, self.post_norm_bias, self.config.layer_norm_eps)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """From SiglipVisionModel's names under `vision_model.` (q, k and v fused as they load);
        KeyError for a missing one, ValueError for a wrong shape."""
        def put(target: torch.Tensor, *names: str) -> None:
            put_tensor(target, tensors, *names)

        p = "embeddings."
        put(self.patch_weight, p + "patch_embedding.weight")
        put(self.patch_bias, p + "patch_embedding.bias")
        put(self.positions, p + "position_embedding.weight")
        for i, layer in enumerate(self.layers):
            layer.load_weights(tensors, f"encoder.layers.{i}.", SIGLIP_LAYER_NAMES)
        put(self.post_norm_weight, "post_layernorm.weight")
        put(self.post_norm_bias, "post_layernorm.bias")
