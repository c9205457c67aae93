"""Llama 4's images (transformers' Llama4VisionModel, then Llama4MultiModalProjector): each square tile of an
image's canvas through its own tower (patches by an unfolded linear map, a class token appended last, learnt
positions, LayerNorm, pre-norm layers of full attention with 2D rotary positions and a GELU MLP, LayerNorm), the
class token dropped, 2x2 patch states pixel-shuffled into one, an MLP, and a linear map into the text model's
embedding space: a tile's rows, row-major, tile after tile, which take the places of its run of image tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.siglip import LLAMA4_LAYER_NAMES, EncoderLayer
from engine.vision.vision_config import VisionConfig

TOWER, PROJECTOR = "vision_model.", "multi_modal_projector."


def tile_rope(patches_per_side: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches + 1, head_dim / 2] of each pair of a head's dimensions, for a tile's patches
    row-major and then its class token: the first half of the pairs turned by a patch's column + 1, the second
    half by its row + 1, the class token not at all (Llama4VisionRotaryEmbedding's table)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * quarter, 2)[:quarter].float() / (2 * quarter)))
    row, col = torch.meshgrid(torch.arange(patches_per_side), torch.arange(patches_per_side), indexing="ij")
    angles = torch.cat([(col.flatten() + 1)[:, None] * inv_freq, (row.flatten() + 1)[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles.new_zeros(1, angles.shape[1])])
    return angles.cos(), angles.sin()


def rotated_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, head_dim] with each consecutive pair of dimensions (real, imaginary) turned by its angle
    (cos, sin [N, head_dim / 2]), in float32 as transformers' complex multiply is."""
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2).type_as(x)


def pixel_shuffle(h: torch.Tensor, merge: int) -> torch.Tensor:
    """h [T, side * side, hidden], row-major → [T, (side / merge)^2, merge^2 * hidden]: each merge x merge square
    of patches one row, its patches' states side by side row by row (transformers' pixel_shuffle order)."""
    tiles, num_patches, hidden = h.shape
    side = round(num_patches ** 0.5)
    grid = h.view(tiles, side // merge, merge, side // merge, merge, hidden)
    return grid.permute(0, 1, 3, 2, 4, 5).reshape(tiles, -1, merge * merge * hidden)


class Llama4ImageEncoder(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.config = config
        self.patch_weight = empty_param(hidden, config.num_channels * patch * patch, dtype=dtype)
        self.class_embedding = empty_param(hidden, dtype=dtype)
        self.positions = empty_param(config.patches_per_side ** 2 + 1, hidden, dtype=dtype)
        self.pre_norm_weight, self.pre_norm_bias = empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(config, dtype, activation="gelu")
                                    for _ in range(config.num_layers))
        self.post_norm_weight, self.post_norm_bias = empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype)
        self.adapter1_weight = empty_param(config.projector_input_dim, config.intermediate_size, dtype=dtype)
        self.adapter2_weight = empty_param(config.projector_output_dim, config.projector_output_dim, dtype=dtype)
        self.projection = empty_param(text_hidden_size, config.out_hidden_size, dtype=dtype)
        # Fixed by the tile's shape, not learnt: float32, as transformers turns q and k.
        cos, sin = tile_rope(config.patches_per_side, hidden // config.num_heads, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        """tiles [T, C, image_size, image_size] (normalized) → [T * tokens_per_image, text hidden size], tile after
        tile."""
        config, hidden = self.config, self.config.hidden_size
        patches = F.unfold(tiles.to(self.patch_weight.dtype), config.patch_size, stride=config.patch_size)
        h = F.linear(patches.transpose(1, 2), self.patch_weight)  # [T, P, hidden], row-major
        h = torch.cat([h, self.class_embedding.expand(h.shape[0], 1, hidden)], dim=1) + self.positions
        h = F.layer_norm(h, (hidden,), self.pre_norm_weight, self.pre_norm_bias, config.layer_norm_eps)
        for layer in self.layers:
            h = layer(h, lambda x: rotated_pairs(x, self.rope_cos, self.rope_sin))
        h = F.layer_norm(h, (hidden,), self.post_norm_weight, self.post_norm_bias, config.layer_norm_eps)
        shuffled = pixel_shuffle(h[:, :-1], config.spatial_merge_size)  # the class token dropped
        adapted = F.gelu(F.linear(F.gelu(F.linear(shuffled, self.adapter1_weight)), self.adapter2_weight))
        return F.linear(adapted, self.projection).flatten(0, 1)

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's rows [tiles * tokens_per_image, text hidden size], of its pixels [C, H, W], a canvas of
        whole tiles split row-major (transformers' split_to_tiles); all images' tiles through the tower at once."""
        side = self.config.image_size
        tiles = [image.reshape(image.shape[0], image.shape[1] // side, side, image.shape[2] // side, side)
                 .permute(1, 3, 0, 2, 4).flatten(0, 1) for image in pixels]  # each [tiles, C, side, side]
        rows = self(torch.cat(tiles))
        return list(rows.split([len(t) * self.config.tokens_per_image for t in tiles]))

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """Its name for checkpoint tensor `name`, under `vision_model.` and `multi_modal_projector.` (as released
        and as transformers 5 saves it), or with `model.` before them; None for another (the text model's)."""
        name = name.removeprefix("model.")
        return name if name.startswith((TOWER, PROJECTOR)) else None

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` by `checkpoint_name` (q, k and v fused as they load); KeyError for a missing one, ValueError
        for a wrong shape."""
        def put(target: torch.Tensor, *names: str) -> None:
            put_tensor(target, tensors, *(TOWER + name for name in names))

        put(self.patch_weight, "patch_embedding.linear.weight")
        put(self.class_embedding, "class_embedding")
        put(self.positions, "positional_embedding_vlm")
        for kind in ("weight", "bias"):
            put(getattr(self, f"pre_norm_{kind}"), f"layernorm_pre.{kind}")
            put(getattr(self, f"post_norm_{kind}"), f"layernorm_post.{kind}")
        for i, layer in enumerate(self.layers):
            layer.load_weights(tensors, f"{TOWER}model.layers.{i}.", LLAMA4_LAYER_NAMES)
        put(self.adapter1_weight, "vision_adapter.mlp.fc1.weight")
        put(self.adapter2_weight, "vision_adapter.mlp.fc2.weight")
        put_tensor(self.projection, tensors, PROJECTOR + "linear_1.weight")
