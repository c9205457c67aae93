"""A prompt's images (Gemma 3's): each one's run of image tokens in the prompt (the span its rows attend
bidirectionally in), and the rows its encoder makes for them, made when a step first computes them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.sequence import Sequence
    from engine.vision.vision_config import VisionConfig


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


def placed_images(vision: VisionConfig | None, prompt_token_ids: list[int], images: list[torch.Tensor]
                  ) -> tuple[tuple[tuple[int, torch.Tensor], ...], tuple[tuple[int, int], ...]]:
    """A prompt's images (as `check_images` passed them) by the first position of each one's run of image
    tokens, and the runs: the spans its rows attend bidirectionally in."""
    if not images:
        return (), ()
    runs = image_runs(prompt_token_ids, vision.image_token_id)
    return tuple((start, pixels) for (start, _), pixels in zip(runs, images, strict=True)), tuple(runs)


def check_images(engine: LLMEngine, prompt_token_ids: list[int], images: list[torch.Tensor]) -> list[tuple[int, int]]:
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
    shape = (vision.num_channels, vision.image_size, vision.image_size)
    for image in images:
        if tuple(image.shape) != shape or not image.is_floating_point():
            raise ValueError(f"an image's pixels must be floats of shape {list(shape)}, got {image.dtype} of "
                             f"shape {list(image.shape)}")
    return runs


def encode_pending_images(encoder: torch.nn.Module, seq: Sequence, device: torch.device | str) -> None:
    """Encode `seq`'s images into its given embeddings, rows by position (once: a request that never
    computes its prompt here, as a decode worker's unless preempted, never encodes them)."""
    starts = [start for start, _ in seq.pending_images]
    features = encoder(torch.stack([pixels for _, pixels in seq.pending_images]).to(device))
    seq.given_embeddings = tuple(zip(starts, features, strict=True))
    seq.pending_images = ()
