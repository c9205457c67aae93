"""A request's prompt given as embeddings (common.proto's PromptEmbeds), and its images (PromptImage), as
the workers' engines take them."""
from __future__ import annotations

import asyncio
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.prompt_embeds import WithheldEmbeddings
from engine.prompt_images import ImageInput, ImageRows, WithheldImage, digest_of
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
    data = given.data  # each read of a bytes field copies it out of the message: read once
    if not data and given.digest and given.num_rows:
        return WithheldEmbeddings((given.num_rows, given.hidden_size), given.digest)
    return _rows(given, data, "prompt_embeds")


def _rows(given: common_pb2.PromptEmbeds, data: bytes, name: str) -> torch.Tensor:
    """The [rows, hidden] tensor `given` holds (`data`, its bytes as read); ValueError for a dtype it cannot be or
    bytes not its shape."""
    dtype = DTYPES.get(given.dtype)
    if dtype is None:
        raise ValueError(f"{name}.dtype must be one of {', '.join(DTYPES)}, got {given.dtype!r}")
    expected = given.num_rows * given.hidden_size * dtype.itemsize
    if not given.num_rows or len(data) != expected:
        raise ValueError(f"{name} holds {len(data)} bytes, not {given.num_rows} rows of "
                         f"{given.hidden_size} {given.dtype} values")
    # A copy the tensor owns and may write: the bytes read are immutable.
    return torch.frombuffer(bytearray(data), dtype=dtype).view(given.num_rows, given.hidden_size)


def given_images(sampling: common_pb2.SamplingParams) -> list[ImageInput | ImageRows | WithheldImage]:
    """Each of `sampling.images` as the engine takes it (one given as its encoder's rows, `ImageRows`; one with
    its pixels or rows withheld, a `WithheldImage`: the engine takes those only in a request prefilled elsewhere);
    ValueError for bytes that are not its shape (the engine checks the shape, and the normalization's numbers,
    against the model's)."""
    images: list[ImageInput | ImageRows | WithheldImage] = []
    for image in sampling.images:
        shape = (image.height, image.width, image.channels)
        if image.HasField("embeds") and (rows := image.embeds.data):
            images.append(ImageRows(_rows(image.embeds, rows, "an image's embeds"), shape, image.digest, image.crop))
            continue
        data = image.rgb  # each read of a bytes field copies it out of the message (a video's, tens of MB): once
        if not data and image.digest:
            images.append(WithheldImage(shape, image.digest, image.crop, image.frames, image.fps))
            continue
        full_shape = (image.frames, *shape) if image.frames else shape
        if len(data) != math.prod(full_shape) or not data:
            raise ValueError(f"an image holds {len(data)} bytes, not uint8 RGB of "
                             f"[{', '.join(map(str, full_shape))}] (nor none, its pixels withheld, with its digest)")
        with warnings.catch_warnings():  # read-only bytes: nothing writes an image's pixels, which it keeps alive
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            rgb = torch.frombuffer(data, dtype=torch.uint8).view(*full_shape)
        images.append(ImageInput(rgb, image.rescale_factor, tuple(image.mean), tuple(image.std), image.digest,
                                 image.crop, image.fps))
    return images


@dataclass(frozen=True)
class GivenInputs:
    """What a request gives besides its token ids, as the engine takes it (`LLMEngine.add_request`'s keywords)."""

    prompt_embeds: torch.Tensor | WithheldEmbeddings | None = None
    images: Sequence[ImageInput | ImageRows | WithheldImage] = ()
    prompt_embeds_digest: str = ""  # the gateway's name for the embeddings: the engine does not hash them again

    def as_kwargs(self) -> dict[str, Any]:
        return {"prompt_embeds": self.prompt_embeds, "images": self.images,
                "prompt_embeds_digest": self.prompt_embeds_digest}


NO_INPUTS = GivenInputs()


async def given_inputs(sampling: common_pb2.SamplingParams) -> GivenInputs:
    """`sampling`'s prompt embeddings and images (`given_embeddings`, `given_images`), read off the event loop,
    each image's digest made there too where the gateway did not give it: copying MBs of rows or pixels and
    hashing them take milliseconds that neither the worker's event loop nor its engine thread should spend.
    At once for a request with neither. ValueError as those two raise it."""
    if not sampling.images and not sampling.HasField("prompt_embeds"):
        return GivenInputs()
    return await asyncio.to_thread(_read_inputs, sampling)


def _read_inputs(sampling: common_pb2.SamplingParams) -> GivenInputs:
    images = given_images(sampling)
    digest_of(images)  # each image's digest, kept on it
    return GivenInputs(given_embeddings(sampling), images, sampling.prompt_embeds.digest)
