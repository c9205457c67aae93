"""A prompt given as embeddings, or a chat's images, on their way to the workers: in the request's
SamplingParams (common.proto's PromptEmbeds and PromptImage, which every worker it reaches reads), and
its cache salt naming them. (Reading them from a request is prompt_embeds.py's and image_inputs.py's.)"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from engine.block_hash import embeddings_digest, image_digest, images_digest, salted_with_embeddings
from protos import common_pb2
from services.gateway.errors import APIError
from services.gateway.request_errors import InvalidRequestError
from services.tokenizer.image_tokens import ImageSize

PLACEHOLDER_TOKEN_ID = 0  # each row's token, as vLLM's: what routes, counts and fills the context
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checked_embeddings(embeds: common_pb2.PromptEmbeds, param: str = "prompt_embeds") -> common_pb2.PromptEmbeds:
    """`embeds` as the gRPC API takes them, when their bytes are their shape; APIError (400) else. (Their
    width against the model's, and their values, are the workers' to check: the engine refuses them.)"""
    size = DTYPE_SIZES.get(embeds.dtype)
    if size is None:
        raise APIError(400, f"{param}.dtype must be one of {', '.join(DTYPE_SIZES)}, got {embeds.dtype!r}",
                       param=param)
    if not embeds.num_rows or not embeds.hidden_size or len(embeds.data) != embeds.num_rows * embeds.hidden_size * size:
        raise APIError(400, f"{param} holds {len(embeds.data)} bytes, not {embeds.num_rows} rows of "
                            f"{embeds.hidden_size} {embeds.dtype} values (at least one row)", param=param)
    return embeds


def check_embedded(params: common_pb2.SamplingParams, prompt_embeds: common_pb2.PromptEmbeds | None) -> None:
    """InvalidRequestError for sampling a prompt given as `prompt_embeds` cannot take, and for embeddings or
    images given in the params (the pipeline puts them there)."""
    if params.HasField("prompt_embeds"):
        raise InvalidRequestError("sampling.prompt_embeds is set by the gateway: give a prompt as embeddings as "
                                  "the request's prompt_embeds", param="sampling.prompt_embeds")
    if params.images:
        raise InvalidRequestError("sampling.images is set by the gateway: give a chat's images as its messages' "
                                  "image parts", param="sampling.images")
    if prompt_embeds is not None and params.HasField("prompt_logprobs"):
        raise InvalidRequestError("a prompt given as embeddings has no tokens to give logprobs of",
                                  param="prompt_logprobs")


@dataclass(frozen=True)
class GivenRows:
    """A prompt given as embeddings, as the workers take it: its rows, kept out of every message the gateway
    makes but the worker requests they are spliced into (request_bytes.py), and the rest, `meta`, their digest
    among it: the router's hashes and the workers' caches tell prompts given as embeddings apart by it, their
    placeholder tokens being all alike."""

    meta: common_pb2.PromptEmbeds  # without `data`
    rows: memoryview

    @classmethod
    def of(cls, embeds: common_pb2.PromptEmbeds, num_rows: int) -> GivenRows:
        """The last `num_rows` rows of `embeds` (all of them, or as truncate_prompt_tokens keeps): one copy
        of their bytes, out of the message, and a hash of them (call off the event loop)."""
        data = memoryview(embeds.data)
        row_bytes = len(data) // embeds.num_rows
        rows = data[-num_rows * row_bytes:] if num_rows < embeds.num_rows else data
        return cls(common_pb2.PromptEmbeds(
            num_rows=num_rows, hidden_size=embeds.hidden_size, dtype=embeds.dtype,
            digest=embeddings_digest(embeds.dtype, (num_rows, embeds.hidden_size), rows)), rows)

    def given_to(self, params: common_pb2.SamplingParams) -> None:
        """`params` carrying them without their rows, and salted with them."""
        params.prompt_embeds.CopyFrom(self.meta)
        params.cache_salt = salted_with_embeddings(params.cache_salt if params.HasField("cache_salt") else None,
                                                   self.meta.digest)


@dataclass(frozen=True)
class ProcessedImage:
    """An image as the model's image processor made it: its pixels, kept out of every message the gateway makes
    but the worker requests they are spliced into (request_bytes.py: copying MBs into messages held the event
    loop), and the rest of what a worker reads of it, `meta`, its digest among it (engine/block_hash.py's
    `image_digest`, the engine's the same); and the crops made of it that go beside it (Gemma 3's pan-and-scan
    crops, Llama 4's global tile), images of their own to the workers."""

    meta: common_pb2.PromptImage  # without `rgb`
    rgb: bytes
    crops: tuple[ProcessedImage, ...] = ()
    times: tuple[float, ...] = ()  # a video's frame pairs' times, in seconds (Qwen3-VL's prompt writes them)
    columns: int = 0  # Step-3.7's: its local crops a row (it the first of them, its global view its last crop)

    @classmethod
    def of(cls, rgb: bytes, shape: tuple[int, int, int], rescale_factor: float, mean: Sequence[float],
           std: Sequence[float], frames: int = 0, fps: float = 0.0) -> ProcessedImage:
        """`rgb`, uint8 [height, width, channels] (`shape`; a video's `frames` of it at `fps`), normalized by
        `rescale_factor`, `mean` and `std`."""
        height, width, channels = shape
        digest = image_digest(rgb, (frames, *shape) if frames else shape, rescale_factor, mean, std, fps)
        return cls(common_pb2.PromptImage(height=height, width=width, channels=channels, rescale_factor=rescale_factor,
                                          mean=mean, std=std, digest=digest, frames=frames, fps=fps), rgb)

    @property
    def digest(self) -> str:
        return self.meta.digest

    @property
    def size(self) -> ImageSize:
        """Its size as resized, its crops' count and a video's frames: how many tokens it takes in a prompt."""
        return ImageSize(self.meta.height, self.meta.width, len(self.crops), self.meta.frames, self.times, self.columns)

    @property
    def with_crops(self) -> tuple[ProcessedImage, ...]:
        """It, then its crops: as many images as the workers take of it, in the prompt's order."""
        return (self, *self.crops)

    @property
    def num_bytes(self) -> int:
        """Its pixels' bytes, and its crops'."""
        return sum(len(image.rgb) for image in self.with_crops)

    def as_crop(self) -> ProcessedImage:
        """It marked a crop of the image before it in the prompt (not counted an image of its own)."""
        meta = common_pb2.PromptImage()
        meta.CopyFrom(self.meta)
        meta.crop = True
        return ProcessedImage(meta, self.rgb)

    def proto(self) -> common_pb2.PromptImage:
        """The image as one message, pixels and all (a copy of them)."""
        whole = common_pb2.PromptImage(rgb=self.rgb)
        whole.MergeFrom(self.meta)
        return whole


@dataclass(frozen=True)
class EmbeddedImage:
    """An image given as its encoder's rows (vLLM's image_embeds; image_embeds.py): `meta` its size that places
    its tokens, its rows' shape and dtype, and what names it (the engine's ImageRows' digest); its rows beside it,
    spliced into a worker's request as an image's pixels are."""

    meta: common_pb2.PromptImage  # its `embeds` without their `data`
    rows: bytes

    @classmethod
    def of(cls, embeds: common_pb2.PromptEmbeds, height: int, width: int) -> EmbeddedImage:
        """`embeds` (rows and all) placed as an image of `height` x `width` pixels."""
        meta = common_pb2.PromptImage(height=height, width=width, channels=3, digest=embeddings_digest(
            embeds.dtype, [embeds.num_rows, embeds.hidden_size, height, width, 3], embeds.data))
        meta.embeds.CopyFrom(embeds)
        meta.embeds.ClearField("data")
        return cls(meta, embeds.data)

    @property
    def digest(self) -> str:
        return self.meta.digest

    @property
    def size(self) -> ImageSize:
        return ImageSize(self.meta.height, self.meta.width)

    @property
    def with_crops(self) -> tuple[EmbeddedImage, ...]:
        return (self,)

    @property
    def num_bytes(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class GivenImages:
    """A prompt's images as the workers take them, and what names them in its cache salt, as the engine
    names them (engine/admission.py's `salted`): hashed once for all its choices."""

    images: tuple[ProcessedImage | EmbeddedImage, ...]  # one each image the prompt's messages hold, its crops with it

    @cached_property
    def sent(self) -> tuple[ProcessedImage | EmbeddedImage, ...]:
        """The images as the workers take them: each followed by its crops."""
        return tuple(item for image in self.images for item in image.with_crops)

    @cached_property
    def digest(self) -> str:
        return images_digest([image.digest for image in self.sent])

    @property
    def sizes(self) -> list[ImageSize]:
        """Each image's size as resized and its crops' count: how many tokens some models' images take."""
        return [image.size for image in self.images]

    @property
    def num_bytes(self) -> int:
        """Their pixels' bytes, their crops' with them."""
        return sum(image.num_bytes for image in self.images)

    def given_to(self, params: common_pb2.SamplingParams) -> None:
        """`params` carrying them without their pixels (a worker's request takes those: request_bytes.py), each
        named by its digest (no worker hashes it again), and salted with them: the same placeholder tokens show
        other images."""
        params.images.extend(image.meta for image in self.sent)
        params.cache_salt = salted_with_embeddings(params.cache_salt if params.HasField("cache_salt") else None,
                                                   self.digest)
