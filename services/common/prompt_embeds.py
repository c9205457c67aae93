"""A request's prompt given as embeddings (common.proto's PromptEmbeds), and its images (PromptImage), as
the workers' engines take them."""
from __future__ import annotations

import asyncio

import torch

from engine.prompt_embeds import WithheldEmbeddings
from engine.prompt_images import ImageInput, WithheldImage, digest_of
from protos import common_pb2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def given_embeddings(sampling: common_pb2.SamplingParams) -> torch.Tensor | WithheldEmbeddings | None:
    """The [rows, hidden] tensor `sampling.prompt_embeds` holds (with its rows withheld, a `WithheldEmbeddings`:
    the engine takes those only in a request prefilled elsewhere); None when the prompt is token ids.
    ValueError for a dtype it cannot be or bytes that are not its shape (the engine checks the
    shape against the model)."""
    if not sampling.HasField("prompt_embeds"):
        return None
    given = sampling.prompt_embeds
    dtype = DTYPES.get(given.dtype)
    if dtype is None:
        raise ValueError(f"prompt_embeds.dtype must be one of {', '.join(DTYPES)}, got {given.dtype!r}")
    if not given.data and given.digest and given.num_rows:
        return WithheldEmbeddings((given.num_rows, given.hidden_size), given.digest)
    expected = given.num_rows * given.hidden_size * dtype.itemsize
    if not given.num_rows or len(given.data) != expected:
        raise ValueError(f"prompt_embeds holds {len(given.data)} bytes, not {given.num_rows} rows of "
                         f"{given.hidden_size} {given.dtype} values")
    # A copy the tensor owns: the message's bytes are immutable, and the request outlives it.
    return torch.frombuffer(bytearray(given.data), dtype=dtype).view(given.num_rows, given.hidden_size)


def given_images(sampling: common_pb2.SamplingParams) -> list[ImageInput | WithheldImage]:
    """Each of `sampling.images` as the engine takes it (one with its pixels withheld, a `WithheldImage`: the
    engine takes those only in a request prefilled elsewhere); ValueError for bytes that are not its shape (the
    engine checks the shape, and the normalization's numbers, against the model's)."""
    images: list[ImageInput | WithheldImage] = []
    for image in sampling.images:
        shape = (image.height, image.width, image.channels)
        if not image.rgb and image.digest:
            images.append(WithheldImage(shape, image.digest))
            continue
        if len(image.rgb) != image.channels * image.height * image.width or not image.rgb:
            raise ValueError(f"an image holds {len(image.rgb)} bytes, not uint8 RGB of [{', '.join(map(str, shape))}]"
                             " (nor none, its pixels withheld, with its digest)")
        rgb = torch.frombuffer(bytearray(image.rgb), dtype=torch.uint8).view(*shape)
        images.append(ImageInput(rgb, image.rescale_factor, tuple(image.mean), tuple(image.std), image.digest))
    return images


async def given_images_hashed(sampling: common_pb2.SamplingParams) -> list[ImageInput | WithheldImage]:
    """`given_images`, off the event loop, each one's digest made there too: copying a large image's bytes and
    hashing them (the engine's cache salt names them) take milliseconds that neither the worker's event loop nor
    its engine thread should spend. At once, [] for a request without images."""
    if not sampling.images:
        return []
    return await asyncio.to_thread(_hashed_images, sampling)


def _hashed_images(sampling: common_pb2.SamplingParams) -> list[ImageInput | WithheldImage]:
    images = given_images(sampling)
    digest_of(images)  # each image's digest, kept on it
    return images
