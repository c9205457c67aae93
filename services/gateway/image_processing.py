"""A model's image processor's settings (preprocessor_config.json, --mm-processor-kwargs and a request's
mm_processor_kwargs over them), and an image made by them as transformers' processor makes it: RGB, resized
(PIL's resampling, as transformers' PIL processors do) to the processor's size (Gemma 3's, with its pan-and-scan
crops where it is on), or to at most its longest edge in whole tokens' pixels (Mistral 3's Pixtral processor), or
to whole tokens within pixel bounds (Qwen-VL's), or to the most patches within a budget in whole squares of them
(Gemma 4's); or into a canvas of tiles (Llama 4's, torchvision's resampling); or into a global view and local crops
(Step-3.7's, torchvision's resampling).
The workers get it so, with the processor's rescale factor, mean and std, which the engine normalizes it by when
it encodes it (engine/prompt_images.py's ImageInput)."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from services.common.mm_limits import VIDEO_KWARGS
from services.gateway.errors import APIError
from services.gateway.given_embeddings import ProcessedImage
from services.gateway.llama4_tiles import MOST_TILES, TileCanvas
from services.gateway.pan_and_scan import KWARGS as PAN_AND_SCAN_KWARGS, PanAndScan
from services.gateway.patch_budget import PatchBudget
from services.gateway.step3p7_views import LocalCrops
from services.tokenizer.image_tokens import pixtral_pixels_per_token


@dataclass(frozen=True)
class ImageProcessing:
    """A model's image processor's settings: to a fixed size (`height` x `width`: Gemma 3's, crops of the image
    beside it by `pan_and_scan`); or, with `tiles`, into a canvas of square tiles of that size (Llama 4's, its
    global tile beside it); or, with `longest_edge`, to at most that on a side, its aspect kept, each side rounded
    up to a whole number of `pixels_per_token` (Mistral 3's Pixtral processor: its patch times its spatial merge);
    or, with `max_pixels`, each side rounded to whole tokens, the pixels kept within [min_pixels, max_pixels]
    (Qwen2.5-VL's smart resize)."""

    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BILINEAR
    longest_edge: int | None = None
    pixels_per_token: int = 1
    merge_size: int = 1  # Qwen-VL's: patches merged into a token, on a side
    min_pixels: int = 0
    max_pixels: int | None = None
    pan_and_scan: PanAndScan | None = None  # None: a processor that makes no crops (only Gemma 3's does)
    tiles: TileCanvas | None = None
    patch_budget: PatchBudget | None = None  # Gemma 4's: to the most patches within its budget, its aspect kept
    local_crops: LocalCrops | None = None  # Step-3.7's: a global view of `height`, and local crops where it makes them
    background: tuple[int, int, int] = (255, 255, 255)  # what transparency shows (vLLM's rgba_background_color)

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
        if str(config.get("image_processor_type", "")).startswith("Gemma4") or "max_soft_tokens" in config:
            # Gemma 4's: rescaled, not normalized (its tower recenters the pixels itself); bicubic unless it says
            budget = PatchBudget(int(config.get("patch_size", 16)), int(config.get("pooling_kernel_size", 3)),
                                 int(config.get("max_soft_tokens", 280)))
            normalized = config.get("do_normalize", False)
            return cls(height=0, width=0, mean=tuple(config["image_mean"]) if normalized else (0.0, 0.0, 0.0),
                       std=tuple(config["image_std"]) if normalized else (1.0, 1.0, 1.0),
                       rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                       resample=int(config.get("resample", Image.Resampling.BICUBIC)), pixels_per_token=budget.square,
                       patch_budget=budget).with_kwargs(overrides or {})
        settings = {"mean": tuple(config["image_mean"]), "std": tuple(config["image_std"]),
                    "rescale_factor": float(config.get("rescale_factor", 1 / 255)),
                    "resample": int(config.get("resample", Image.Resampling.BILINEAR))}
        if "merge_size" in config:  # Qwen2-VL's processor: bicubic unless it says
            settings["resample"] = int(config.get("resample", Image.Resampling.BICUBIC))
            step = int(config.get("patch_size", 14)) * int(config["merge_size"])
            most = int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
            return cls(height=0, width=0, pixels_per_token=step, merge_size=int(config["merge_size"]), max_pixels=most,
                       min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                       **settings).with_kwargs(overrides or {})
        if "longest_edge" in size and "height" not in size:
            longest = int(size["longest_edge"])
            step = pixtral_pixels_per_token(processor, _read_json(Path(model_dir) / "config.json"))
            return cls(height=longest, width=longest, longest_edge=longest, pixels_per_token=step,
                       **settings).with_kwargs(overrides or {})
        if "height" not in size or "width" not in size:
            raise ValueError(f"{path}: size must give height and width, or longest_edge, got {size}")
        if str(config.get("image_processor_type", "")).startswith("Step3p7"):
            crops = LocalCrops(int(size["height"]), int(config.get("patch_size", 504)),
                               int(config.get("max_image_size", 3024)))
            if size["height"] != size["width"]:
                raise ValueError(f"{path}: a global view must be square, got {size}")
            return cls(height=crops.size, width=crops.size, local_crops=crops, **settings).with_kwargs(overrides or {})
        if "max_patches" in config or str(config.get("image_processor_type", "")).startswith("Llama4"):
            if size["height"] != size["width"]:
                raise ValueError(f"{path}: a tile must be square, got {size}")
            tiles = TileCanvas(int(size["height"]), int(config.get("max_patches", 16)),
                               bool(config.get("resize_to_max_canvas", False)))
            return cls(height=tiles.tile_size, width=tiles.tile_size, tiles=tiles,
                       **settings).with_kwargs(overrides or {})
        return cls(height=int(size["height"]), width=int(size["width"]),
                   pan_and_scan=PanAndScan().with_kwargs(config), **settings).with_kwargs(overrides or {})

    def with_kwargs(self, kwargs: Mapping[str, Any]) -> ImageProcessing:
        """These settings with `kwargs` (--mm-processor-kwargs', or a request's mm_processor_kwargs, as
        `checked_processor_kwargs` passed them) over them, as transformers' processors take them: Qwen-VL's
        min_pixels and max_pixels (or size's shortest_edge and longest_edge), Pixtral's size's longest_edge, Gemma
        3's pan-and-scan settings, Llama 4's max_patches and resize_to_max_canvas; a video's (VIDEO_KWARGS) left
        to the video processor. ValueError for one this processor has not (a fixed size's tower takes no other
        size)."""
        kwargs = {key: value for key, value in kwargs.items() if key not in VIDEO_KWARGS}
        size = dict(kwargs.get("size") or {})
        pixel_bounds = {"min_pixels", "max_pixels"} & set(kwargs)
        cropping = set(PAN_AND_SCAN_KWARGS) & set(kwargs)
        tiling = {"max_patches", "resize_to_max_canvas"} & set(kwargs)
        if self.patch_budget is not None:  # Gemma 4's
            unknown = set(kwargs) - {"max_soft_tokens"}
            changes = {"patch_budget": self.patch_budget.with_soft_tokens(kwargs["max_soft_tokens"])
                       } if "max_soft_tokens" in kwargs and not unknown else {}
        elif self.max_pixels is not None:  # Qwen-VL's smart resize
            unknown = set(size) - {"shortest_edge", "longest_edge"} | cropping | tiling
            changes = {"min_pixels": kwargs.get("min_pixels", size.get("shortest_edge", self.min_pixels)),
                       "max_pixels": kwargs.get("max_pixels", size.get("longest_edge", self.max_pixels))}
        elif self.longest_edge is not None:  # Pixtral's
            unknown = set(size) - {"longest_edge"} | pixel_bounds | cropping | tiling
            edge = size.get("longest_edge", self.longest_edge)
            changes = {"longest_edge": edge, "height": edge, "width": edge}
        elif self.local_crops is not None:  # Step-3.7's: its tokens' counts are the saved sizes' (the tokenizer's)
            unknown = set(kwargs) - {"max_image_size"}
            changes = {"local_crops": replace(self.local_crops, max_image_size=int(kwargs["max_image_size"]))
                       } if "max_image_size" in kwargs and not unknown else {}
        elif self.tiles is not None:  # Llama 4's
            unknown = set(size) | pixel_bounds | cropping
            if kwargs.get("max_patches", 0) > MOST_TILES:  # its canvases are listed, and one allocated, per image
                raise ValueError(f"max_patches must be at most {MOST_TILES}, got {kwargs['max_patches']}")
            changes = {"tiles": TileCanvas(self.tiles.tile_size, kwargs.get("max_patches", self.tiles.max_tiles),
                                           kwargs.get("resize_to_max_canvas", self.tiles.resize_to_max_canvas))
                       } if tiling else {}
        else:  # a tower of one size: Gemma 3's
            unknown = set(size) | pixel_bounds | tiling | (cropping if self.pan_and_scan is None else set())
            changes = {"pan_and_scan": self.pan_and_scan.with_kwargs(kwargs)} if cropping and not unknown else {}
        if unknown:
            raise ValueError(f"this model's image processor takes no {', '.join(sorted(unknown))}")
        return replace(self, **changes) if changes else self

    def with_media_io(self, kwargs: Mapping[str, Any]) -> ImageProcessing:
        """These settings with --media-io-kwargs' (or a request's media_io_kwargs, as `checked_media_io_kwargs` gave
        them) image settings over them: its rgba_background_color."""
        color = kwargs.get("image", {}).get("rgba_background_color")
        return replace(self, background=color) if color is not None and color != self.background else self

    def size_of(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of an image of that size once resized, as transformers' processor resizes it."""
        if self.patch_budget is not None:
            try:
                return self.patch_budget.size_of(height, width)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
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

    def processed(self, image: Image.Image, most_bytes: int | None = None) -> ProcessedImage:
        """`image` as the processor makes it, with its crops where it makes them (cut from the image before
        either is resized, as transformers' processor cuts them). APIError (413), before any pixels are made, where
        they would take more than `most_bytes` (a request's settings may ask a huge resize, canvas or hundreds of
        crops)."""
        image = rgb(image, self.background)
        if self.local_crops is not None:
            plan = self.local_crops.plan(image.height, image.width)
            num_bytes = (self.height * self.width + plan.columns * plan.rows * self.local_crops.patch_size ** 2) * 3
            _check_bytes(f"an image with its {plan.columns * plan.rows} local crops", num_bytes, most_bytes,
                         "send a smaller one")
            crops, global_view, columns = self.local_crops.views(image)
            first, *rest = [self._of(view) for view in (*crops, global_view)]
            return replace(first, crops=tuple(view.as_crop() for view in rest), columns=columns) if rest else first
        if self.tiles is not None:
            height, width = self.tiles.canvas_of(image.height, image.width)
            num_bytes = (height * width + (self.height * self.width if (height, width) != (self.height, self.width)
                                           else 0)) * 3
            _check_bytes(f"an image's canvas of {height // self.height}x{width // self.width} tiles", num_bytes,
                         most_bytes, "ask fewer tiles (mm_processor_kwargs' max_patches)")
            canvas, global_tile = self.tiles.tiled(image, (height, width))
            whole, *crops = [self._of(part) for part in (canvas, global_tile) if part is not None]
        else:
            height, width = self.size_of(image.height, image.width)
            # Before resizing: a request's min_pixels (Qwen-VL's) may ask a small image scaled up to billions.
            _check_bytes(f"an image of {image.width}x{image.height} pixels resized to {width}x{height}",
                         height * width * 3, most_bytes, "send a smaller one, or bound it by mm_processor_kwargs "
                         "(Qwen-VL's max_pixels)")
            whole, *crops = [self._processed(part) for part in (image, *self._crops(image, most_bytes))]
        return replace(whole, crops=tuple(crop.as_crop() for crop in crops)) if crops else whole

    def _crops(self, image: Image.Image, most_bytes: int | None) -> list[Image.Image]:
        if self.pan_and_scan is None:
            return []
        boxes = self.pan_and_scan.crop_boxes(image.height, image.width)
        num_bytes = (1 + len(boxes)) * self.height * self.width * 3
        _check_bytes(f"an image with its {len(boxes)} pan-and-scan crops", num_bytes, most_bytes,
                     "ask fewer crops (mm_processor_kwargs' pan_and_scan_max_num_crops)")
        return [image.crop(box) for box in boxes]

    def _processed(self, image: Image.Image) -> ProcessedImage:
        return self._of(self.resized(image))

    def _of(self, resized: np.ndarray) -> ProcessedImage:
        return ProcessedImage.of(resized.tobytes(), resized.shape, self.rescale_factor, self.mean, self.std)


def _check_bytes(what: str, num_bytes: int, most_bytes: int | None, remedy: str) -> None:
    """APIError (413) for pixels past what a message to a worker carries, before they are made."""
    if most_bytes is not None and num_bytes > most_bytes:
        raise APIError(413, f"{what} takes {num_bytes / 2**20:.1f} MiB as the model's image processor makes it, "
                            f"more than a message to a worker carries ({most_bytes / 2**20:.1f} MiB, "
                            f"--max-message-bytes): {remedy}", param="messages")


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


def rgb(image: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """`image` in RGB, any transparency composited onto `background` (white: as transformers' convert_to_rgb and
    vLLM do)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (*background, 255)), image).convert("RGB")
    return image.convert("RGB")
