"""How a multimodal model's prompt holds an image, as transformers' processor expands the mark its chat template
writes where each image goes: Gemma 3's a run of one placeholder token per row of the image's encoding between
begin and end marks; Mistral 3's (Pixtral's processor) a row of placeholders per row of the image's grid of
tokens, each row ended by a break, the last by an end token; Qwen2.5-VL's one run of the grid's tokens: as many
tokens as the image's size makes, for those two (Qwen2-VL's and Qwen2.5-VL's videos one run of their frame pairs' grids
of tokens); Llama 4's a run a tile of the image's canvas, between tile
separators, then its global tile's run; Gemma 4's a run of a token a square of its patches between begin and end
marks. Gemma 3's image with pan-and-scan crops is written as its processor writes it: the original's run, then each
crop's."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

QWEN_IMAGE_TOKEN, QWEN_VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
QWEN_VISION_START, QWEN_VISION_END = "<|vision_start|>", "<|vision_end|>"
# Whose images and videos are served, by model_type (North's by Qwen3-VL's processor, under marks of its own).
QWEN_VIDEOS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "cohere_compass")
# whose frame pairs each go after their time
TIMED_VIDEOS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "cohere_compass")
# CohereCompassProcessor's marks: image, video, vision start and end
NORTH_MARKS = ("<|IMAGE_PAD|>", "<|VIDEO_PAD|>", "<|VISION_START|>", "<|VISION_END|>")
PIXTRAL_TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
# Step3p7Processor's: an image's mark and each of its tokens, its local crops' marks and newline, its global view's.
STEP3P7_MARKS = ("<im_patch>", "<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>")
# Llama4Processor's, by the names processor_config.json gives them.
LLAMA4_TOKENS = {"image_token": "<|image|>", "start_of_image_token": "<|image_start|>",
                 "end_of_image_token": "<|image_end|>", "patch_token": "<|patch|>",
                 "tile_x_separator_token": "<|tile_x_separator|>", "tile_y_separator_token": "<|tile_y_separator|>"}


class ImageSize(NamedTuple):
    """An image's size in pixels as its processor resized it, and the crops made of it that go beside it
    (Gemma 3's pan-and-scan); or a video's frames' size, and how many there are."""

    height: int
    width: int
    num_crops: int = 0
    frames: int = 0  # a video's; 0 for an image
    times: tuple[float, ...] = ()  # a video's frame pairs' times in seconds (Qwen3-VL writes them)
    columns: int = 0  # Step-3.7's: its local crops a row (its crops are those, then its global view)


@dataclass(frozen=True)
class ImageTokens:
    """Gemma 3's: every image the same run."""

    begin: str  # the template's mark of an image: "<start_of_image>"
    token: str  # each row's placeholder: "<image_soft_token>"
    end: str  # "<end_of_image>"
    tokens_per_image: int

    def expanded(self, text: str, image_sizes: Sequence[ImageSize] | None, num_images: int) -> str:
        """`text` (a rendered chat) with each image's mark made its whole run, and with its crops' runs after it
        where `image_sizes` gives it crops, in Gemma3Processor's words; ValueError unless it has a mark for
        each of `num_images` (their sizes, as resized, do not matter)."""
        _check_marks(text, self.begin, num_images)
        run = f"\n\n{self.begin}{self.token * self.tokens_per_image}{self.end}\n\n"
        crops = [size.num_crops for size in image_sizes or ()]
        if not any(crops):
            return text.replace(self.begin, run)
        if len(crops) != num_images:
            raise ValueError(f"{num_images} image(s) need their crops' counts, got {len(crops)}")
        pieces = text.split(self.begin)
        return pieces[0] + "".join(
            (f"Here is the original image {run} and here are some crops to help you see better "
             + " ".join([run] * n) if n else run) + after for n, after in zip(crops, pieces[1:], strict=True))


@dataclass(frozen=True)
class ImageGridTokens:
    """Mistral 3's: an image's tokens a grid of its size."""

    token: str  # the template's mark of an image, and each of its tokens' placeholder: "[IMG]"
    row_break: str  # "[IMG_BREAK]"
    end: str  # "[IMG_END]"
    pixels_per_token: int  # on a side: the processor's patch size times its spatial merge

    def expanded(self, text: str, image_sizes: Sequence[ImageSize] | None, num_images: int) -> str:
        """`text` with the mark of each image, of `image_sizes` as its processor resized it,
        made its grid of tokens; ValueError without a mark and a size for each of `num_images`."""
        return _each_image(text, self.token, image_sizes, num_images, self._grid)

    def _grid(self, height: int, width: int) -> str:
        rows, cols = height // self.pixels_per_token, width // self.pixels_per_token
        if not rows or not cols:
            raise ValueError(f"an image of {height}x{width} pixels makes no tokens (a token takes "
                             f"{self.pixels_per_token}x{self.pixels_per_token})")
        grid = (self.token * cols + self.row_break) * rows
        return grid[:-len(self.row_break)] + self.end


@dataclass(frozen=True)
class ImageRunTokens:
    """Qwen-VL's: an image's tokens one run, as many as the squares of its size; a video's one run of as many a
    pair of its frames (Qwen2-VL's and Qwen2.5-VL's), or a run a pair, each after its time (Qwen3-VL's)."""

    token: str  # the template's mark of an image, and each of its tokens: "<|image_pad|>"
    pixels_per_token: int  # on a side: the patch size times the spatial merge
    video: str | None = None  # the mark of a video, and each of its tokens: "<|video_pad|>"; None: takes none
    frames_per_patch: int = 2  # a video's frames one patch spans (temporal_patch_size)
    # Qwen3-VL's: the template's video between its vision marks made a run of each frame pair, between marks of its
    # own, after its time ("<1.5 seconds>"), as Qwen3VLProcessor writes it.
    timed: bool = False
    vision_start: str = QWEN_VISION_START
    vision_end: str = QWEN_VISION_END

    def expanded(self, text: str, image_sizes: Sequence[ImageSize] | None, num_images: int) -> str:
        """`text` with the mark of each image (and video), of `image_sizes` as its processor resized it, made its
        run; ValueError without a mark and a size for each of `num_images`, or for a video's size at an image's
        mark (or the converse)."""
        if not self.video:
            return _each_image(text, self.token, image_sizes, num_images, self._run)
        video_mark = self.vision_start + self.video + self.vision_end if self.timed else self.video
        marks = re.compile(f"{re.escape(self.token)}|{re.escape(video_mark)}")
        found = marks.findall(text)
        if len(found) != num_images:
            raise ValueError(f"the chat template wrote {len(found)} image or video mark(s) ({self.token}, "
                             f"{self.video}) for {num_images} image(s) and video(s)")
        _check_sizes(image_sizes, num_images)
        pieces = marks.split(text)
        runs = []
        for mark, size in zip(found, image_sizes, strict=True):
            if (mark == video_mark) != bool(size.frames):
                raise ValueError(f"the chat template wrote {mark} where the prompt's {len(runs) + 1}. item is "
                                 f"{'a video' if size.frames else 'an image'}")
            runs.append(self._timed_runs(size) if self.timed and size.frames else
                        self._run(size.height, size.width, size.frames))
        return pieces[0] + "".join(run + after for run, after in zip(runs, pieces[1:], strict=True))

    def _timed_runs(self, size: ImageSize) -> str:
        pairs = -(-size.frames // self.frames_per_patch)
        if len(size.times) != pairs:
            raise ValueError(f"a video of {pairs} frame pair(s) needs each one's time, got {len(size.times)}")
        run = self.video * self._squares(size.height, size.width)
        return "".join(f"<{time:.1f} seconds>{self.vision_start}{run}{self.vision_end}" for time in size.times)

    def _run(self, height: int, width: int, frames: int = 0) -> str:
        if frames:
            return self.video * (-(-frames // self.frames_per_patch) * self._squares(height, width))
        return self.token * self._squares(height, width)

    def _squares(self, height: int, width: int) -> int:
        return (height // self.pixels_per_token) * (width // self.pixels_per_token)


@dataclass(frozen=True)
class TiledImageTokens:
    """Llama 4's: an image's tokens a run of patch tokens a tile of its canvas, tiles in a row between column
    separators, each row ended by a row separator, then the mark and its global tile's run (a one-tile image's
    canvas is its only run), between begin and end marks."""

    mark: str  # the template's mark of an image, and the one before its global tile: "<|image|>"
    begin: str  # "<|image_start|>"
    end: str  # "<|image_end|>"
    patch: str  # each of a tile's tokens: "<|patch|>"
    column_break: str  # "<|tile_x_separator|>"
    row_break: str  # "<|tile_y_separator|>"
    tile_size: int  # a tile's side in pixels
    tokens_per_tile: int

    def expanded(self, text: str, image_sizes: Sequence[ImageSize] | None, num_images: int) -> str:
        """`text` with the mark of each image, of `image_sizes` (its canvas, as its processor resized it), made its
        tiles' tokens; ValueError without a mark and a size for each of `num_images`."""
        return _each_image(text, self.mark, image_sizes, num_images, self._tiles, takes_crops=True)

    def _tiles(self, height: int, width: int) -> str:
        rows, cols = height // self.tile_size, width // self.tile_size
        if not rows or not cols:
            raise ValueError(f"an image's canvas of {height}x{width} pixels holds no {self.tile_size}-pixel tile")
        run = self.patch * self.tokens_per_tile
        tiles = (self.column_break.join([run] * cols) + self.row_break) * rows if rows * cols > 1 else ""
        return f"{self.begin}{tiles}{self.mark}{run}{self.end}"


@dataclass(frozen=True)
class SquareRunTokens:
    """Gemma 4's: an image's tokens one run between begin and end marks, a token a square of its patches."""

    token: str  # the template's mark of an image, and each of its tokens' placeholder: "<|image|>"
    begin: str  # "<|image>"
    end: str  # "<image|>"
    pixels_per_token: int  # on a side: the patch size times the pooling kernel's

    def expanded(self, text: str, image_sizes: Sequence[ImageSize] | None, num_images: int) -> str:
        """`text` with the mark of each image, of `image_sizes` as its processor resized it, made its run, as
        Gemma4Processor writes it; ValueError without a mark and a size for each of `num_images`."""
        return _each_image(text, self.token, image_sizes, num_images, self._run)

    def _run(self, height: int, width: int) -> str:
        squares = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        if not squares:
            raise ValueError(f"an image of {height}x{width} pixels makes no tokens (a token takes "
                             f"{self.pixels_per_token}x{self.pixels_per_token})")
        return f"{self.begin}{self.token * squares}{self.end}"


@dataclass(frozen=True)
class LocalViewTokens:
    """Step-3.7's: an image's tokens a run a local crop between patch marks, row by row, each row but the last ended
    by a newline mark, then its global view's run between image marks."""

    token: str  # the template's mark of an image, and each of its tokens' placeholder: "<im_patch>"
    patch_start: str  # "<patch_start>"
    patch_end: str  # "<patch_end>"
    newline: str  # "<patch_newline>"
    begin: str  # "<im_start>"
    end: str  # "<im_end>"
    global_tokens: int  # a global view's run
    local_tokens: int  # a local crop's

    def expanded(self, text: str, image_sizes: Sequence[ImageSize] | None, num_images: int) -> str:
        """`text` with the mark of each image made its crops' and global view's tokens, as Step3p7Processor writes
        them, its crops and their columns as `image_sizes` give them (an image with crops is the first of them, its
        global view the last crop); ValueError without a mark and a size for each of `num_images`."""
        _check_sizes(image_sizes, num_images)
        _check_marks(text, self.token, num_images)
        pieces = text.split(self.token)
        return pieces[0] + "".join(self._views(size) + after
                                   for size, after in zip(image_sizes, pieces[1:], strict=True))

    def _views(self, size: ImageSize) -> str:
        crops = size.num_crops  # its first local crop is the image, its global view a crop
        if crops and (not size.columns or crops % size.columns):
            raise ValueError(f"an image of {crops} local crops needs their columns, got {size.columns}")
        local = f"{self.patch_start}{self.token * self.local_tokens}{self.patch_end}"
        rows = crops // size.columns if crops else 0
        views = "".join(local + (self.newline if col == size.columns - 1 and row < rows - 1 else "")
                        for row in range(rows) for col in range(size.columns))
        return f"{views}{self.begin}{self.token * self.global_tokens}{self.end}"


# How a model's prompt holds an image, one of the above.
PromptImageTokens = (ImageTokens | ImageGridTokens | ImageRunTokens | TiledImageTokens | SquareRunTokens
                     | LocalViewTokens)


def _each_image(text: str, mark: str, image_sizes: Sequence[ImageSize] | None, num_images: int,
                tokens_of: Callable[[int, int], str], takes_crops: bool = False) -> str:
    """`text` with each image's `mark`, in turn, made `tokens_of` its (height, width); ValueError without a mark
    and a size for each of `num_images`, or for crops of an image that takes none (Gemma 3's pan-and-scan crops,
    Llama 4's global tile, go with theirs)."""
    _check_sizes(image_sizes, num_images)
    if not takes_crops and any(size.num_crops for size in image_sizes):
        raise ValueError("this model's images take no crops (pan-and-scan is Gemma 3's)")
    _check_marks(text, mark, num_images)
    pieces = text.split(mark)
    return pieces[0] + "".join(tokens_of(size.height, size.width) + after
                               for size, after in zip(image_sizes, pieces[1:], strict=True))


def _check_sizes(image_sizes: Sequence[ImageSize] | None, num_images: int) -> None:
    if image_sizes is None or len(image_sizes) != num_images:
        raise ValueError(f"this model's image tokens depend on each image's size: {num_images} image(s) need "
                         f"their sizes, got {0 if image_sizes is None else len(image_sizes)}")


def _check_marks(text: str, mark: str, num_images: int) -> None:
    marks = text.count(mark)
    if marks != num_images:
        raise ValueError(f"the chat template wrote {marks} image mark(s) ({mark}) for {num_images} image(s)")


def read_image_tokens(tokenizer_config: dict[str, Any], processor_config: dict[str, Any],
                      model_config: dict[str, Any]
                      ) -> PromptImageTokens | None:
    """Gemma 3's from tokenizer_config.json's boi/image/eoi tokens (top-level or among its extra special
    tokens) and processor_config.json's image_seq_length (or config.json's mm_tokens_per_image); Gemma 4's from the
    same tokens and its image processor's patch and pooling kernel; Mistral 3's
    from processor_config.json (PixtralProcessor's tokens, patch size and spatial merge; config.json's where
    it has none); Qwen-VL's from config.json; Llama 4's from processor_config.json's tokens, patch size and pixel
    shuffle ratio (Llama4Processor's defaults where it has none) and config.json's tile size; Step-3.7's from its
    image processor's sizes (Step3p7Processor's marks); None for a model without them."""
    if model_config.get("model_type") == "llama4":
        return _llama4_tokens(processor_config, model_config)
    if model_config.get("model_type") == "step3p7":
        return _step3p7_tokens(processor_config)
    extra = tokenizer_config.get("extra_special_tokens")
    named = {**(extra if isinstance(extra, dict) else {}), **tokenizer_config}
    marks = [named.get(name) for name in ("boi_token", "image_token", "eoi_token")]
    if model_config.get("model_type") == "gemma4" and all(isinstance(mark, str) and mark for mark in marks):
        return _gemma4_tokens(*marks, processor_config, model_config)
    count = processor_config.get("image_seq_length") or model_config.get("mm_tokens_per_image")
    if all(isinstance(mark, str) and mark for mark in marks) and count:
        return ImageTokens(*marks, tokens_per_image=int(count))
    if model_config.get("model_type") in QWEN_VIDEOS:
        vision = model_config.get("vision_config") or {}
        step = int(vision.get("patch_size", 14)) * int(vision.get("spatial_merge_size", 2))
        image, video, start, end = NORTH_MARKS if model_config["model_type"] == "cohere_compass" else (
            QWEN_IMAGE_TOKEN, QWEN_VIDEO_TOKEN, QWEN_VISION_START, QWEN_VISION_END)
        return ImageRunTokens(image, step, video, int(vision.get("temporal_patch_size", 2)),
                              timed=model_config["model_type"] in TIMED_VIDEOS, vision_start=start, vision_end=end)
    if processor_config.get("processor_class") != "PixtralProcessor" and model_config.get("model_type") != "mistral3":
        return None
    tokens = {name: processor_config.get(name) or default for name, default in PIXTRAL_TOKENS.items()}
    return ImageGridTokens(tokens["image_token"], tokens["image_break_token"], tokens["image_end_token"],
                           pixels_per_token=pixtral_pixels_per_token(processor_config, model_config))


def pixtral_pixels_per_token(processor_config: dict[str, Any], model_config: dict[str, Any]) -> int:
    """A side of the square of pixels one of Mistral 3's image tokens stands for: its processor's patch size
    times its spatial merge (processor_config.json's, as transformers' PixtralProcessor reads them; else
    config.json's, as Mistral3Config has them by default)."""
    vision = model_config.get("vision_config") or {}
    patch = processor_config.get("patch_size") or vision.get("patch_size") or 14
    merge = processor_config.get("spatial_merge_size") or model_config.get("spatial_merge_size") or 2
    return int(patch) * int(merge)


def _gemma4_tokens(begin: str, token: str, end: str, processor_config: dict[str, Any], model_config: dict[str, Any]
                   ) -> SquareRunTokens:
    """Its square's side: processor_config.json's image processor's patch and pooling kernel (as transformers 5 saves
    them), else config.json's vision_config's (Gemma4VisionConfig's defaults where neither gives them)."""
    image = processor_config.get("image_processor") or processor_config
    vision = model_config.get("vision_config") or {}
    patch = image.get("patch_size") or vision.get("patch_size") or 16
    pooling = image.get("pooling_kernel_size") or vision.get("pooling_kernel_size") or 3
    return SquareRunTokens(token, begin, end, pixels_per_token=int(patch) * int(pooling))


def _llama4_tokens(processor_config: dict[str, Any], model_config: dict[str, Any]) -> TiledImageTokens:
    vision = model_config.get("vision_config") or {}
    tokens = [processor_config.get(name) or default for name, default in LLAMA4_TOKENS.items()]
    patch = int(processor_config.get("patch_size") or vision.get("patch_size") or 14)
    ratio = float(processor_config.get("pixel_shuffle_ratio") or vision.get("pixel_shuffle_ratio") or 0.5)
    tile = int(vision.get("image_size") or 448)  # Llama4VisionConfig's default
    # As Llama4Processor counts them: a tile's patches, fewer by the pixel shuffle's 1 / ratio^2.
    per_tile = (tile // patch) * (tile // patch) // round(1 / ratio ** 2)
    return TiledImageTokens(*tokens, tile_size=tile, tokens_per_tile=per_tile)


def _step3p7_tokens(processor_config: dict[str, Any]) -> LocalViewTokens:
    """A view's tokens: its side over the tower's patch times its downsampling's stride, squared, as Step3p7Processor
    counts them, for the global view (the image processor's size) and a local crop (its patch_size); the image
    processor's settings as transformers 5 saves them in processor_config.json, Step3p7ImageProcessor's defaults
    where it has none."""
    image = processor_config.get("image_processor") or processor_config
    stride = int(image.get("vision_patch_size") or 14) * int(image.get("downsampler_stride") or 4)
    side = int((image.get("size") or {}).get("height") or 728)
    local = int(image.get("patch_size") or 504)
    return LocalViewTokens(*STEP3P7_MARKS, global_tokens=(side // stride) ** 2, local_tokens=(local // stride) ** 2)
