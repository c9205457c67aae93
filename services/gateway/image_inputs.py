"""A chat message's images, as the model's image processor makes them (preprocessor_config.json): read
from a data: URL, an http(s) URL, or a file:// one under --allowed-local-media-path; made RGB and resized
(PIL's resampling) as transformers' PIL image processors do: to the processor's size (Gemma 3's, with its
pan-and-scan crops where it is on), or to at most its longest edge in whole tokens' pixels (Mistral 3's
Pixtral processor), or to whole tokens within pixel bounds (Qwen-VL's). They go to the workers so, with the
processor's rescale factor, mean and std, which the engine normalizes them by when it encodes them
(engine/prompt_images.py's ImageInput)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import httpx
import numpy as np
from PIL import Image, UnidentifiedImageError

from services.common.mm_limits import checked_processor_kwargs
from services.gateway.errors import APIError
from services.gateway.given_embeddings import GivenImages, ProcessedImage
from services.gateway.image_cache import ProcessedImageCache
from services.gateway.pan_and_scan import KWARGS as PAN_AND_SCAN_KWARGS, PanAndScan
from services.tokenizer.image_tokens import pixtral_pixels_per_token

MAX_IMAGE_BYTES = 32 * 2**20  # an image's encoded bytes, fetched or given
# Of a message to a worker, what a prompt's images leave for the rest of the request (its prompt's token ids).
MESSAGE_HEADROOM_BYTES = 2**20
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageProcessing:
    """A model's image processor's settings: to a fixed size (`height` x `width`: Gemma 3's, crops of the image
    beside it by `pan_and_scan`); or, with
    `longest_edge`, to at most that on a side, its aspect kept, each side rounded up to a whole number of
    `pixels_per_token` (Mistral 3's Pixtral processor: its patch times its spatial merge); or, with
    `max_pixels`, each side rounded to whole tokens, the pixels kept within [min_pixels, max_pixels] (Qwen2.5-VL's
    smart resize)."""

    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BILINEAR
    longest_edge: int | None = None
    pixels_per_token: int = 1
    min_pixels: int = 0
    max_pixels: int | None = None
    pan_and_scan: PanAndScan | None = None  # None: a processor that makes no crops (only Gemma 3's does)

    @classmethod
    def from_dir(cls, model_dir: Path, overrides: dict | None = None) -> ImageProcessing:
        """The model's image processor's settings: preprocessor_config.json's (as released), or
        processor_config.json's `image_processor` (as transformers 5 saves them), `overrides` over them
        (--mm-processor-kwargs: min_pixels, max_pixels, size's keys); ValueError for none, or one this gateway
        cannot follow."""
        path = Path(model_dir) / "preprocessor_config.json"
        processor = _read_json(Path(model_dir) / "processor_config.json")
        if path.is_file():
            config = json.loads(path.read_text())
        else:
            path = Path(model_dir) / "processor_config.json"
            config = processor.get("image_processor")
            if not isinstance(config, dict):
                raise ValueError(f"{model_dir}: no preprocessor_config.json (a model that takes images needs its "
                                 "image processor's settings)")
        if config.get("do_center_crop"):
            raise ValueError(f"{path}: do_center_crop is not served")
        size = config.get("size") or {}
        settings = {"mean": tuple(config["image_mean"]), "std": tuple(config["image_std"]),
                    "rescale_factor": float(config.get("rescale_factor", 1 / 255)),
                    "resample": int(config.get("resample", Image.Resampling.BILINEAR))}
        if "merge_size" in config:  # Qwen2-VL's processor: bicubic unless it says
            settings["resample"] = int(config.get("resample", Image.Resampling.BICUBIC))
            step = int(config.get("patch_size", 14)) * int(config["merge_size"])
            most = int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
            return cls(height=0, width=0, pixels_per_token=step, max_pixels=most,
                       min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                       **settings).with_kwargs(overrides or {})
        if "longest_edge" in size and "height" not in size:
            longest = int(size["longest_edge"])
            step = pixtral_pixels_per_token(processor, _read_json(Path(model_dir) / "config.json"))
            return cls(height=longest, width=longest, longest_edge=longest, pixels_per_token=step,
                       **settings).with_kwargs(overrides or {})
        if "height" not in size or "width" not in size:
            raise ValueError(f"{path}: size must give height and width, or longest_edge, got {size}")
        return cls(height=int(size["height"]), width=int(size["width"]),
                   pan_and_scan=PanAndScan().with_kwargs(config), **settings).with_kwargs(overrides or {})

    def with_kwargs(self, kwargs: Mapping[str, Any]) -> ImageProcessing:
        """These settings with `kwargs` (--mm-processor-kwargs', or a request's mm_processor_kwargs, as
        `checked_processor_kwargs` passed them) over them, as transformers' processors take them: Qwen-VL's
        min_pixels and max_pixels (or size's shortest_edge and longest_edge), Pixtral's size's longest_edge, Gemma
        3's pan-and-scan settings. ValueError for one this processor has not (a fixed size's tower takes no other
        size)."""
        size = dict(kwargs.get("size") or {})
        pixel_bounds = {"min_pixels", "max_pixels"} & set(kwargs)
        cropping = set(PAN_AND_SCAN_KWARGS) & set(kwargs)
        if self.max_pixels is not None:  # Qwen-VL's smart resize
            unknown = set(size) - {"shortest_edge", "longest_edge"} | cropping
            changes = {"min_pixels": kwargs.get("min_pixels", size.get("shortest_edge", self.min_pixels)),
                       "max_pixels": kwargs.get("max_pixels", size.get("longest_edge", self.max_pixels))}
        elif self.longest_edge is not None:  # Pixtral's
            unknown = set(size) - {"longest_edge"} | pixel_bounds | cropping
            edge = size.get("longest_edge", self.longest_edge)
            changes = {"longest_edge": edge, "height": edge, "width": edge}
        else:  # Gemma 3's
            unknown = set(size) | pixel_bounds | (cropping if self.pan_and_scan is None else set())
            changes = {"pan_and_scan": self.pan_and_scan.with_kwargs(kwargs)} if cropping and not unknown else {}
        if unknown:
            raise ValueError(f"this model's image processor takes no {', '.join(sorted(unknown))}")
        return replace(self, **changes) if changes else self

    def size_of(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of an image of that size once resized, as transformers' processor resizes it."""
        if self.max_pixels is not None:
            return smart_resize(height, width, self.pixels_per_token, self.min_pixels, self.max_pixels)
        if self.longest_edge is None:
            return self.height, self.width
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        step = self.pixels_per_token
        return (height - 1) // step * step + step, (width - 1) // step * step + step

    def resized(self, image: Image.Image) -> np.ndarray:
        """`image` (RGB) at the processor's size: uint8 [height, width, 3]."""
        height, width = self.size_of(image.height, image.width)
        if not height or not width:  # a side under one pixel once the other fits the longest edge
            raise APIError(400, f"an image of {image.width}x{image.height} pixels is too narrow for this model's "
                                f"image processor (longest edge {self.longest_edge})", param="messages")
        return np.array(image.resize((width, height), resample=self.resample))

    def processed(self, image: Image.Image) -> ProcessedImage:
        """`image` as the processor makes it, with its crops where it makes them (cut from the image before
        either is resized, as transformers' processor cuts them)."""
        image = rgb(image)
        whole, *crops = [self._processed(part) for part in (image, *self._crops(image))]
        return replace(whole, crops=tuple(crop.as_crop() for crop in crops)) if crops else whole

    def _crops(self, image: Image.Image) -> list[Image.Image]:
        if self.pan_and_scan is None:
            return []
        return [image.crop(box) for box in self.pan_and_scan.crop_boxes(image.height, image.width)]

    def _processed(self, image: Image.Image) -> ProcessedImage:
        resized = self.resized(image)
        return ProcessedImage.of(resized.tobytes(), resized.shape, self.rescale_factor, self.mean, self.std)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's processor's (height, width): each side rounded to a multiple of `factor`, scaled down or up, its
    aspect kept, where its pixels fall outside [min_pixels, max_pixels]. APIError (400) for an image more than 200
    times as long as it is wide, as transformers refuses it."""
    if max(height, width) / min(height, width) > 200:
        raise APIError(400, f"an image of {width}x{height} pixels: its aspect ratio must be under 200",
                       param="messages")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB, any transparency composited onto white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ChatImages:
    """What reads a chat's images for a model that takes them."""

    processing: ImageProcessing
    allowed_local_path: Path | None = None  # file:// images are read under it (--allowed-local-media-path)
    limit: int | None = None  # a prompt's most images (--limit-mm-per-prompt); None: any
    cache: ProcessedImageCache | None = None  # None: each image made again (--mm-processor-cache-gb 0)
    # The most bytes of pixels a prompt's images may take: they travel in one gRPC message to each worker
    # (--max-message-bytes); None: no bound here.
    max_bytes: int | None = None

    async def read(self, urls: list[str], param: str = "messages",
                   processor_kwargs: Mapping[str, Any] | None = None) -> GivenImages:
        """The images' pixels, in order, read by the processor's settings with `processor_kwargs` (a request's
        mm_processor_kwargs, as vLLM takes them) over them; APIError (400) naming `param` for one that cannot be
        read, or for more than the limit, and naming mm_processor_kwargs for settings not served."""
        if self.limit is not None and len(urls) > self.limit:
            raise APIError(400, f"{len(urls)} images in one prompt, more than this server's limit of {self.limit} "
                                "(--limit-mm-per-prompt)", param=param)
        processing = self.processing
        if processor_kwargs:
            try:
                processing = processing.with_kwargs(checked_processor_kwargs(dict(processor_kwargs),
                                                                             "mm_processor_kwargs"))
            except ValueError as e:
                raise APIError(400, str(e), param="mm_processor_kwargs") from None
        # A data: URL as it is (its text names its bytes), another's bytes fetched or read here.
        sources = [url if is_data_url(url) else await _image_bytes(url, self.allowed_local_path, param) for url in urls]
        # Off the event loop: decoding and resizing a photo takes tens of milliseconds (PIL lets go of the GIL),
        # hashing its pixels a few more, and a data: URL's base64 3 ms a megabyte.
        images = await asyncio.to_thread(lambda: GivenImages(tuple(self._processed(source, processing, param)
                                                                   for source in sources)))
        size = images.num_bytes
        if self.max_bytes is not None and size > self.max_bytes:
            raise APIError(413, f"the prompt's images take {size / 2**20:.1f} MiB as the model's image processor "
                                f"resizes them, more than a message to a worker carries ({self.max_bytes / 2**20:.1f} "
                                "MiB, --max-message-bytes): send fewer or smaller images, or bound them by "
                                "mm_processor_kwargs (Qwen-VL's max_pixels)", param=param)
        return images

    def _processed(self, source: str | bytes, processing: ImageProcessing, param: str) -> ProcessedImage:
        """The image of a data: URL (`source` a str) or of encoded bytes, from the cache where it holds it (by
        the URL's text, and the settings it was read by: a hit decodes no base64)."""
        def make() -> ProcessedImage:
            data = data_url_bytes(source, param) if isinstance(source, str) else source
            return processing.processed(read_image(data, param))

        if self.cache is None:
            return make()
        settings = b"" if processing is self.processing else repr(processing).encode()
        return self.cache.processed(settings + (source.encode() if isinstance(source, str) else source), make)


def read_image(data: bytes, param: str) -> Image.Image:
    """The image `data` encodes (PNG, JPEG, ...); APIError (400) for bytes that are not one."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise APIError(400, f"{param}: not an image this server reads: {e}", param=param) from None
    return image


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes a base64 data: URL holds; APIError (400) for another."""
    header, _, encoded = url.partition(",")
    if not header.endswith(";base64"):
        raise APIError(400, f"{param}: a data URL's image must be base64 (data:image/...;base64,...)", param=param)
    try:
        return base64.b64decode(encoded, validate=True)
    except binascii.Error as e:
        raise APIError(400, f"{param}: the data URL is not base64: {e}", param=param) from None


async def _image_bytes(url: str, allowed_local_path: Path | None, param: str) -> bytes:
    """The encoded bytes of an http(s) or file:// URL's image."""
    scheme = urlparse(url).scheme
    if scheme in ("http", "https"):
        try:
            async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True) as client, \
                    client.stream("GET", url) as response:
                response.raise_for_status()
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_IMAGE_BYTES:
                        raise APIError(400, f"{param}: the image is over {MAX_IMAGE_BYTES} bytes", param=param)
                return bytes(body)
        except httpx.HTTPError as e:
            raise APIError(400, f"{param}: the image could not be fetched: {e}", param=param) from None
    if scheme == "file":
        if allowed_local_path is None:
            raise APIError(400, f"{param}: file:// images are read only under the gateway's "
                                "--allowed-local-media-path", param=param)
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(allowed_local_path.resolve()) or not path.is_file():
            raise APIError(400, f"{param}: {path} is not a file under --allowed-local-media-path", param=param)
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise APIError(400, f"{param}: the image is over {MAX_IMAGE_BYTES} bytes", param=param)
        return path.read_bytes()
    raise APIError(400, f"{param}: an image URL is data:, http(s): or file:, got {url[:40]!r}", param=param)
