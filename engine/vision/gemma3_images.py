"""Gemma 3's images (transformers' Gemma3Model.get_image_features): SigLIP's patch states, averaged
over square windows down to mm_tokens_per_image, RMS-normed (Gemma's 1 + weight), projected into
the text model's embedding space: the rows that take the place of an image's tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.siglip import SiglipVisionTower
from engine.vision.vision_config import VisionConfig

TOWER, PROJECTOR = "vision_tower.", "multi_modal_projector."


class Gemma3ImageEncoder(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.tower = SiglipVisionTower(config, dtype)
        self.norm_weight = empty_param(config.hidden_size, dtype=dtype)
        self.projection = empty_param(config.hidden_size, text_hidden_size, dtype=dtype)
        self.pool = config.patches_per_side // round(config.tokens_per_image ** 0.5)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, C, image_size, image_size] → [B, tokens_per_image, text hidden size]."""
        patches = self.tower(pixels)
        side = self.config.patches_per_side
        grid = patches.transpose(1, 2).reshape(patches.shape[0], patches.shape[2], side, side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.layer_norm_eps)
        normed = (normed * (1.0 + self.norm_weight.float())).type_as(pooled)
        return (normed @ self.projection).type_as(patches)

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's rows [tokens_per_image, text hidden size], of its pixels [C, image_size, image_size]."""
        return list(self(torch.stack(pixels)))

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """Its name for checkpoint tensor `name`, as released (the tower's under `vision_tower.vision_model.`)
        or as transformers 5 saves it (under `vision_tower.`, or `model.` before that); None for another
        (the text model's, SigLIP's pooling head)."""
        name = name.removeprefix("model.")
        if name.startswith(TOWER):
            name = TOWER + name.removeprefix(TOWER).removeprefix("vision_model.")
            return None if name.startswith(TOWER + "head.") else name
        return name if name.startswith(PROJECTOR) else None

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` by `checkpoint_name`."""
        self.tower.load_weights({name.removeprefix(TOWER): t for name, t in tensors.items() if name.startswith(TOWER)})
        put_tensor(self.norm_weight, tensors, PROJECTOR + "mm_soft_emb_norm.weight")
        put_tensor(self.projection, tensors, PROJECTOR + "mm_input_projection_weight")
