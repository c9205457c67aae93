"""Mistral 3's images (transformers' Mistral3Model.get_image_features): Pixtral's patch states, RMS-normed,
each square of spatial_merge_size x spatial_merge_size patches merged into one row by a learnt linear map,
then projected into the text model's embedding space by a two-layer MLP: an image's rows, row-major, which
take the places of its [IMG] tokens (a run of them per row of merged patches)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parameters import empty_param
from engine.vision.loading import put_tensor
from engine.vision.pixtral import ACTIVATIONS, PixtralVisionTower, rms_norm
from engine.vision.vision_config import VisionConfig

TOWER, PROJECTOR = "vision_tower.", "multi_modal_projector."


class Mistral3ImageEncoder(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, merge = config.hidden_size, config.spatial_merge_size
        self.config = config
        self.tower = PixtralVisionTower(config, dtype)
        self.norm_weight = empty_param(hidden, dtype=dtype)
        self.merge_weight = empty_param(hidden, hidden * merge * merge, dtype=dtype)
        self.linear1_weight = empty_param(text_hidden_size, hidden, dtype=dtype)
        self.linear2_weight = empty_param(text_hidden_size, text_hidden_size, dtype=dtype)
        self.linear1_bias = empty_param(text_hidden_size, dtype=dtype) if config.projector_bias else None
        self.linear2_bias = empty_param(text_hidden_size, dtype=dtype) if config.projector_bias else None
        self.act = ACTIVATIONS[config.projector_act]

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [C, height, width], each side a multiple of patch_size x spatial_merge_size →
        [rows x cols of merged patches, text hidden size]."""
        config, merge = self.config, self.config.spatial_merge_size
        patches = rms_norm(self.tower(pixels), self.norm_weight, config.projector_norm_eps)
        rows, cols = pixels.shape[1] // config.patch_size, pixels.shape[2] // config.patch_size
        grid = patches.T.reshape(1, -1, rows, cols)
        # Each square's patches side by side, channel by channel: the order the merging layer was learnt in.
        merged = F.linear(F.unfold(grid, kernel_size=merge, stride=merge)[0].T, self.merge_weight)
        hidden = self.act(F.linear(merged, self.linear1_weight, self.linear1_bias))
        return F.linear(hidden, self.linear2_weight, self.linear2_bias)

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's rows, one image at a time (their sizes differ)."""
        return [self(image) for image in pixels]

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """Its name for checkpoint tensor `name`, as released (under `vision_tower.` and
        `multi_modal_projector.`) or as transformers 5 saves it (`model.` before them); None for another."""
        name = name.removeprefix("model.")
        return name if name.startswith((TOWER, PROJECTOR)) else None

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` by `checkpoint_name`."""
        self.tower.load_weights({name.removeprefix(TOWER): t for name, t in tensors.items() if name.startswith(TOWER)})
        put_tensor(self.norm_weight, tensors, PROJECTOR + "norm.weight")
        put_tensor(self.merge_weight, tensors, PROJECTOR + "patch_merger.merging_layer.weight")
        for i, (weight, bias) in enumerate(((self.linear1_weight, self.linear1_bias),
                                            (self.linear2_weight, self.linear2_bias)), start=1):
            put_tensor(weight, tensors, PROJECTOR + f"linear_{i}.weight")
            if bias is not None:
                put_tensor(bias, tensors, PROJECTOR + f"linear_{i}.bias")
