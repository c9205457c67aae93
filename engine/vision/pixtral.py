"""Pixtral's vision transformer (Mistral 3's tower), as transformers' PixtralVisionModel computes its last
layer's states for one image of any size: patches by a strided convolution, an RMSNorm, pre-norm layers of
full attention with 2D rotary positions (a patch's row rotates half of each pair of a head's dimensions, its
column the other half) and a gated MLP. Images are encoded one at a time: transformers' block-diagonal mask
keeps each image's patches to themselves all the same."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.vision_config import VisionConfig

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Mistral's RMSNorm: normed in float32, cast back, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def axial_rope(rows: int, cols: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows * cols, head_dim] of each patch, row-major: the even frequencies turned by its row,
    the odd ones by its column."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    row, col = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    angles = torch.cat([row.flatten()[:, None].float() * inv_freq[0::2],
                        col.flatten()[:, None].float() * inv_freq[1::2]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class PixtralLayer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads, self.act = config.num_heads, ACTIVATIONS[config.hidden_act]
        self.attention_norm = empty_param(hidden, dtype=dtype)
        self.qkv_weight = empty_param(3 * hidden, hidden, dtype=dtype)
        self.out_weight = empty_param(hidden, hidden, dtype=dtype)
        self.ffn_norm = empty_param(hidden, dtype=dtype)
        self.gate_up_weight = empty_param(2 * inner, hidden, dtype=dtype)
        self.down_weight = empty_param(hidden, inner, dtype=dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # h [P, hidden]
        x = rms_norm(h, self.attention_norm, 1e-5)
        q, k, v = F.linear(x, self.qkv_weight).unflatten(-1, (3, self.num_heads, -1)).unbind(1)  # [P, heads, dim]
        q, k, v = rotated(q.transpose(0, 1), cos, sin), rotated(k.transpose(0, 1), cos, sin), v.transpose(0, 1)
        attended = F.scaled_dot_product_attention(q, k, v)  # [heads, P, dim]
        h = h + F.linear(attended.transpose(0, 1).flatten(1), self.out_weight)
        gate, up = F.linear(rms_norm(h, self.ffn_norm, 1e-5), self.gate_up_weight).chunk(2, dim=-1)
        return h + F.linear(self.act(gate) * up, self.down_weight)


class PixtralVisionTower(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.patch_weight = empty_param(config.hidden_size, config.num_channels, config.patch_size, config.patch_size,
                                        dtype=dtype)
        self.pre_norm = empty_param(config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(PixtralLayer(config, dtype) for _ in range(config.num_layers))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [C, height, width] (normalized) → each patch's state [rows * cols, hidden], row-major."""
        patches = F.conv2d(pixels[None].to(self.patch_weight.dtype), self.patch_weight, stride=self.config.patch_size)
        rows, cols = patches.shape[-2:]
        h = rms_norm(patches[0].flatten(1).T, self.pre_norm, 1e-5)
        cos, sin = axial_rope(rows, cols, self.config.hidden_size // self.config.num_heads, self.config.rope_theta,
                              h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """From PixtralVisionModel's names (q, k and v fused as they load, the MLP's gate and up too);
        KeyError for a missing one, ValueError for a wrong shape."""
        def put(target: torch.Tensor, *names: str) -> None:
            put_tensor(target, tensors, *names)

        put(self.patch_weight, "patch_conv.weight")
        put(self.pre_norm, "ln_pre.weight")
        for i, layer in enumerate(self.layers):
            p = f"transformer.layers.{i}."
            put(layer.attention_norm, p + "attention_norm.weight")
            put(layer.qkv_weight, *(p + f"attention.{x}_proj.weight" for x in "qkv"))
            put(layer.out_weight, p + "attention.o_proj.weight")
            put(layer.ffn_norm, p + "ffn_norm.weight")
            put(layer.gate_up_weight, p + "feed_forward.gate_proj.weight", p + "feed_forward.up_proj.weight")
            put(layer.down_weight, p + "feed_forward.down_proj.weight")
