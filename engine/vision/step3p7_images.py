"""Step-3.7's images (transformers' Step3p7VisionModel, then its multi_modal_projector): each square view of an image
(its global view, its local crops: images of their own here, in the prompt's order) through the tower (patches by a
strided convolution without bias, learnt positions resampled bilinearly to the view's grid, LayerNorm, pre-norm
layers of full attention with 2D rotary positions and a quick-GELU MLP, each branch scaled by a learnt vector), its
grid of patch states downsampled by two 3x3 convolutions of stride 2, and a linear map into the text model's
embedding space: a row a 4x4 square of patches, row-major, which take the places of the view's run of image tokens.

Read by StepFun's names as released (and as transformers 5 saves them): an OpenCLIP tower under `vision_model.`
(`conv1`, `positional_embedding`, `ln_pre`, `transformer.resblocks.N.` with q, k and v fused in `attn.in_proj_*`,
`vit_downsampler1`/`2`) and `vit_large_projector`. Its q and k rows turn by RoPE a pair of adjacent dimensions at a
time as released: reordered as they load into the halves transformers' tower turns (PermuteForRope's order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.siglip import SIGLIP_LAYER_NAMES, EncoderLayer
from engine.vision.vision_config import VisionConfig

TOWER, PROJECTOR = "vision_model.", "vit_large_projector."


def view_rope(rows: int, cols: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows * cols, head_dim] of a view's patches, row-major: a head's first quarter of frequencies
    turned by a patch's column, its second by its row, repeated for the rotated half (Step3p7VisionRotaryEmbedding's
    table, which rotates the halves of a head)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2).float() / (head_dim // 2)))
    row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    angles = torch.cat([col.flatten()[:, None] * inv_freq, row.flatten()[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotated_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, head_dim] turned by RoPE over its halves (cos, sin [N, head_dim]), in float32 as transformers'
    tower turns it."""
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-second, first], dim=-1) * sin).type_as(x)


def pairs_to_halves(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q or k rows (weight [heads * dim, in] or bias [heads * dim]) whose RoPE turns adjacent pairs, reordered so that
    it turns a head's halves: each head's even dimensions first, then its odd ones."""
    per_head = rows.reshape(num_heads, -1, 2, *rows.shape[1:])
    return per_head.transpose(1, 2).reshape(rows.shape)


class Step3p7ImageEncoder(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.config = config
        self.patch_weight = empty_param(hidden, config.num_channels, patch, patch, dtype=dtype)
        self.positions = empty_param(config.patches_per_side ** 2, hidden, dtype=dtype)
        self.pre_norm_weight, self.pre_norm_bias = empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(config, dtype, activation=config.hidden_act, layer_scales=True)
                                    for _ in range(config.num_layers))
        self.down1_weight = empty_param(2 * hidden, hidden, 3, 3, dtype=dtype)
        self.down1_bias = empty_param(2 * hidden, dtype=dtype)
        self.down2_weight = empty_param(4 * hidden, 2 * hidden, 3, 3, dtype=dtype)
        self.down2_bias = empty_param(4 * hidden, dtype=dtype)
        self.projection = empty_param(text_hidden_size, 4 * hidden, dtype=dtype)
        self.projection_bias = empty_param(text_hidden_size, dtype=dtype) if config.projector_bias else None

    @torch.inference_mode()
    def forward(self, views: torch.Tensor) -> torch.Tensor:
        """views [B, C, H, W] (normalized, each of one size) → [B, (H / 56) * (W / 56), text hidden size]."""
        config = self.config
        grid = F.conv2d(views.to(self.patch_weight.dtype), self.patch_weight, stride=config.patch_size)
        rows, cols = grid.shape[2:]
        h = grid.flatten(2).transpose(1, 2) + self._positions(rows, cols)
        h = F.layer_norm(h, (h.shape[-1],), self.pre_norm_weight, self.pre_norm_bias, config.layer_norm_eps)
        cos, sin = view_rope(rows, cols, config.hidden_size // config.num_heads, config.rope_theta)
        for layer in self.layers:
            h = layer(h, lambda x: rotated_halves(x, cos, sin))
        grid = h.transpose(1, 2).unflatten(2, (rows, cols))
        grid = F.conv2d(grid, self.down1_weight, self.down1_bias, stride=2, padding=1)
        grid = F.conv2d(grid, self.down2_weight, self.down2_bias, stride=2, padding=1)
        return F.linear(grid.flatten(2).transpose(1, 2), self.projection, self.projection_bias)

    def _positions(self, rows: int, cols: int) -> torch.Tensor:
        """The learnt positions of a view's patch grid: the square they were learnt on, resampled bilinearly to
        another (as transformers' interpolate_pos_encoding does, unaligned corners)."""
        side = self.config.patches_per_side
        if (rows, cols) == (side, side):
            return self.positions
        square = self.positions.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        resampled = F.interpolate(square, size=(rows, cols), mode="bilinear", align_corners=False)
        return resampled.permute(0, 2, 3, 1).reshape(rows * cols, -1)

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each view's rows [(H / 56) * (W / 56), text hidden size], of its pixels [C, H, W]; views of one size
        through the tower together."""
        rows: list[torch.Tensor | None] = [None] * len(pixels)
        for shape in dict.fromkeys(tuple(view.shape) for view in pixels):
            same = [i for i, view in enumerate(pixels) if tuple(view.shape) == shape]
            for i, encoded in zip(same, self(torch.stack([pixels[i] for i in same])), strict=True):
                rows[i] = encoded
        return rows

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """Its name for checkpoint tensor `name`, under `vision_model.` and `vit_large_projector.` (with `model.`
        before them too); None for another (the text model's)."""
        name = name.removeprefix("model.")
        return name if name.startswith((TOWER, PROJECTOR)) else None

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` by `checkpoint_name`: the layers' fused q, k and v split, q's and k's rows reordered for RoPE
        over halves; KeyError for a missing one, ValueError for a wrong shape."""
        def put(target: torch.Tensor, *names: str) -> None:
            put_tensor(target, tensors, *(TOWER + name for name in names))

        put(self.patch_weight, "conv1.weight")
        put(self.positions, "positional_embedding")
        put(self.pre_norm_weight, "ln_pre.weight")
        put(self.pre_norm_bias, "ln_pre.bias")
        heads = self.config.num_heads
        for i, layer in enumerate(self.layers):
            p = f"{TOWER}transformer.resblocks.{i}."
            named = {p + f"{ours}.{kind}": tensors[p + f"{stored}.{kind}"] for kind in ("weight", "bias")
                     for ours, stored in (("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"),
                                          ("self_attn.out_proj", "attn.out_proj"), ("mlp.fc1", "mlp.c_fc"),
                                          ("mlp.fc2", "mlp.c_proj"))}
            for kind in ("weight", "bias"):
                q, k, v = tensors[p + f"attn.in_proj_{kind}"].chunk(3)
                named |= {p + f"self_attn.q_proj.{kind}": pairs_to_halves(q, heads),
                          p + f"self_attn.k_proj.{kind}": pairs_to_halves(k, heads), p + f"self_attn.v_proj.{kind}": v}
            layer.load_weights(named, p, SIGLIP_LAYER_NAMES)
            put_tensor(layer.scale1, tensors, p + "ls_1.gamma")
            put_tensor(layer.scale2, tensors, p + "ls_2.gamma")
        for n in (1, 2):
            put(getattr(self, f"down{n}_weight"), f"vit_downsampler{n}.weight")
            put(getattr(self, f"down{n}_bias"), f"vit_downsampler{n}.bias")
        put_tensor(self.projection, tensors, PROJECTOR + "weight")
        if self.projection_bias is not None:
            put_tensor(self.projection_bias, tensors, PROJECTOR + "bias")
