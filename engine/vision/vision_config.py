"""A multimodal checkpoint's image side, from config.json: its vision tower's shape and how many
embedding rows an image becomes in the prompt, under which token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the tower's square input, in pixels
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    tokens_per_image: int  # embedding rows an image becomes (Gemma 3's mm_tokens_per_image)
    image_token_id: int  # the prompt's placeholder of each row
    num_channels: int = 3

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


# Gemma3Config's and SiglipVisionConfig's, where config.json leaves them out.
GEMMA3_IMAGE_DEFAULTS = {"mm_tokens_per_image": 256, "image_token_index": 262_144}
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
                   "num_channels": 3}


def gemma3_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Gemma 3's (Gemma3ForConditionalGeneration's config.json): a SigLIP tower whose patches are
    average-pooled to mm_tokens_per_image rows. ValueError for a shape it cannot pool so."""
    vision = {**SIGLIP_DEFAULTS, **(cfg.get("vision_config") or {})}
    image = {**GEMMA3_IMAGE_DEFAULTS, **{k: cfg[k] for k in GEMMA3_IMAGE_DEFAULTS if k in cfg}}
    config = VisionConfig(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=vision["hidden_act"],
        tokens_per_image=int(image["mm_tokens_per_image"]), image_token_id=int(image["image_token_index"]),
        num_channels=int(vision["num_channels"]))
    side = round(config.tokens_per_image ** 0.5)
    if side * side != config.tokens_per_image or config.patches_per_side % side:
        raise ValueError(f"mm_tokens_per_image {config.tokens_per_image} does not pool a "
                         f"{config.patches_per_side}x{config.patches_per_side} grid of patches")
    if config.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not served (gelu_pytorch_tanh only)")
    return config
