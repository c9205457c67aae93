"""A prompt's images (Gemma 3's): each as its model's image processor resized it (`ImageInput`), its run of
image tokens in the prompt (the span its rows attend bidirectionally in), and the rows its encoder makes
for them, made when a step first computes them (a decode worker's request, only after a preemption)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.block_hash import images_digest

if TYPE_CHECKING:
    from engine import sequence
    from engine.llm_engine import LLMEngine
    from engine.vision.vision_config import VisionConfig


@dataclass(frozen=True, eq=False)
class ImageInput:
    """An image resized by its model's image processor, and what its pixels are normalized by: a quarter of
    the float pixels' bytes, normalized only when it is encoded (as transformers' processors normalize:
    rescaled in float64, cast to float32, less the mean, over the std, channels first)."""

    rgb: torch.Tensor  # uint8 [height, width, channels]
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def pixels(self) -> torch.Tensor:
        """float32 [channels, height, width]."""
        rescaled = (self.rgb.double() * self.rescale_factor).float()
        mean, std = torch.tensor(self.mean, dtype=torch.float32), torch.tensor(self.std, dtype=torch.float32)
        return ((rescaled - mean) / std).permute(2, 0, 1).contiguous()


def digest_of(images: Sequence[ImageInput]) -> str:
    """What names them in a cache salt (engine/block_hash.py's `images_digest`)."""
    return images_digest([(image.rgb.contiguous().numpy().tobytes(), tuple(image.rgb.shape), image.rescale_factor,
                           image.mean, image.std) for image in images])


def image_runs(prompt_token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """Each run of consecutive image tokens, as positions [start, end)."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(prompt_token_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs


def placed_images(vision: VisionConfig | None, prompt_token_ids: list[int], images: Sequence[ImageInput]
                  ) -> tuple[tuple[tuple[int, ImageInput], ...], tuple[tuple[int, int], ...]]:
    """A prompt's images (as `check_images` passed them) by the first position of each one's run of image
    tokens, and the runs: the spans its rows attend bidirectionally in."""
    if not images:
        return (), ()
    runs = image_runs(prompt_token_ids, vision.image_token_id)
    return tuple((start, image) for (start, _), image in zip(runs, images, strict=True)), tuple(runs)


def check_images(engine: LLMEngine, prompt_token_ids: list[int], images: Sequence[ImageInput]) -> list[tuple[int, int]]:
    """Where each image goes: its run of image tokens. ValueError for images the model takes none of, or
    that the prompt does not place (a run for each, of the encoder's rows), or pixels not its input's shape."""
    vision, limit = engine.model_config.vision, engine.config.limit_images
    if vision is None:
        raise ValueError(f"{engine.model_config.architecture} takes no images here"
                         + (" (its images are limited to 0 a prompt)" if limit == 0 else ""))
    if limit is not None and len(images) > limit:
        raise ValueError(f"{len(images)} images in one prompt, more than its limit of {limit}")
    runs = image_runs(prompt_token_ids, vision.image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"the prompt holds {len(runs)} run(s) of image tokens (id {vision.image_token_id}) for "
                         f"{len(images)} image(s)")
    for start, end in runs:
        if end - start != vision.tokens_per_image:
            raise ValueError(f"an image takes {vision.tokens_per_image} image tokens, the prompt has {end - start} "
                             f"at position {start}")
    shape = (vision.image_size, vision.image_size, vision.num_channels)
    for image in images:
        if tuple(image.rgb.shape) != shape or image.rgb.dtype != torch.uint8:
            raise ValueError(f"an image must be uint8 of shape {list(shape)} (resized by the model's image "
                             f"processor), got {image.rgb.dtype} of shape {list(image.rgb.shape)}")
        if len(image.mean) != vision.num_channels or len(image.std) != vision.num_channels or 0 in image.std:
            raise ValueError(f"an image's mean and std must give a number for each of its {vision.num_channels} "
                             "channels, std not 0")
    return runs


def encode_pending_images(encoder: torch.nn.Module, seq: sequence.Sequence, device: torch.device | str) -> None:
    """Encode `seq`'s images into its given embeddings, rows by position (once: a request that never
    computes its prompt here, as a decode worker's unless preempted, never normalizes or encodes them)."""
    starts = [start for start, _ in seq.pending_images]
    features = encoder(torch.stack([image.pixels() for _, image in seq.pending_images]).to(device))
    seq.given_embeddings = tuple(zip(starts, features, strict=True))
    seq.pending_images = ()
