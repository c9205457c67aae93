"""A request's prompt given as embeddings (common.proto's PromptEmbeds), and its images (PromptImage), as
the workers' engines take them."""
from __future__ import annotations

import torch

from protos import common_pb2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def given_embeddings(sampling: common_pb2.SamplingParams) -> torch.Tensor | None:
    """The [rows, hidden] tensor `sampling.prompt_embeds` holds; None when the prompt is token ids.
    ValueError for a dtype it cannot be or bytes that are not its shape (the engine checks the
    shape against the model)."""
    if not sampling.HasField("prompt_embeds"):
        return None
    given = sampling.prompt_embeds
    dtype = DTYPES.get(given.dtype)
    if dtype is None:
        raise ValueError(f"prompt_embeds.dtype must be one of {', '.join(DTYPES)}, got {given.dtype!r}")
    expected = given.num_rows * given.hidden_size * dtype.itemsize
    if not given.num_rows or len(given.data) != expected:
        raise ValueError(f"prompt_embeds holds {len(given.data)} bytes, not {given.num_rows} rows of "
                         f"{given.hidden_size} {given.dtype} values")
    # A copy the tensor owns: the message's bytes are immutable, and the request outlives it.
    return torch.frombuffer(bytearray(given.data), dtype=dtype).view(given.num_rows, given.hidden_size)


def given_images(sampling: common_pb2.SamplingParams) -> list[torch.Tensor]:
    """Each of `sampling.images` as a float32 [channels, height, width] tensor; ValueError for bytes that
    are not their shape (the engine checks the shape against the model's)."""
    images = []
    for image in sampling.images:
        if not image.channels or not image.height or not image.width \
                or len(image.pixels) != 4 * image.channels * image.height * image.width:
            raise ValueError(f"an image holds {len(image.pixels)} bytes, not float32 pixels of "
                             f"[{image.channels}, {image.height}, {image.width}]")
        images.append(torch.frombuffer(bytearray(image.pixels), dtype=torch.float32)
                      .view(image.channels, image.height, image.width))
    return images
