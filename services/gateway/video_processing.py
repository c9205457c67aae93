"""A model's video processor's settings (transformers' Qwen2VLVideoProcessor's and Qwen3VLVideoProcessor's, as
AutoVideoProcessor reads them, --media-io-kwargs' and a request's mm_processor_kwargs over them): which frames of a
video are kept, as vLLM samples these models' videos (Qwen's 2 frames a second, at least 4 and at most 768; or, where
--media-io-kwargs gives num_frames, that many spread evenly from the first frame to the last, as vLLM's OpenCV loader
spreads them), and the size they are resized to (smart resize within the processor's pixel bounds; Qwen3-VL's bounds
the whole video's). video_frames.py decodes them so."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from services.gateway.image_processing import smart_resize

OVERRIDES = ("num_frames", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class VideoProcessing:
    """A model's video processor's settings (transformers' Qwen2VLVideoProcessor's; `timed`, Qwen3VLVideoProcessor's),
    and how a video's frames are sampled: `fps` a second within [min_frames, max_frames] (Qwen's), or `num_frames` of
    them spread evenly (vLLM's --media-io-kwargs; -1: every frame)."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, the processor's default
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    num_frames: int | None = None
    # Qwen3-VL's: frames sampled by rounding, the pixel bounds the whole video's, each frame pair's time kept
    timed: bool = False

    @classmethod
    def from_dir(cls, model_dir: Path, overrides: Mapping[str, Any] | None = None,
                 timed: bool = False) -> VideoProcessing:
        """The settings as transformers' AutoVideoProcessor loads them from `model_dir` (`timed`: Qwen3-VL's, its
        processor's defaults under them), `overrides` (--media-io-kwargs' video num_frames; min_pixels,
        max_pixels) over them."""
        config = _video_processor_config(Path(model_dir))
        if config.get("resample", 3) != 3 or config.get("cap_pixels_per_frame"):  # 3: PIL's BICUBIC
            raise ValueError(f"{model_dir}: only the video processor's bicubic resize without a per-video pixel cap "
                             "is served")
        given = {name: value for name, value in config.items() if value is not None}
        # As Qwen2VLVideoProcessor.__init__: size's bounds, top-level min_pixels/max_pixels over them (a released
        # Qwen2-VL's preprocessor_config.json gives only those, its images' bounds), the class's where neither does.
        defaults = QWEN3_VL_DEFAULTS if timed else {}
        size = given.get("size", {"shortest_edge": defaults.get("min_pixels", cls.min_pixels),
                                  "longest_edge": defaults.get("max_pixels", cls.max_pixels)})
        bounds = {"min_pixels": given.get("min_pixels", size.get("shortest_edge")),
                  "max_pixels": given.get("max_pixels", size.get("longest_edge"))}
        if missing := [name for name, value in bounds.items() if value is None]:
            raise ValueError(f"{model_dir}: the video processor's settings give no {' or '.join(missing)}")
        settings = {name: given[name] for name in ("patch_size", "merge_size", "temporal_patch_size",
                                                   "rescale_factor", "fps", "min_frames", "max_frames")
                    if name in given}
        settings |= {name: tuple(given[name]) for name in ("image_mean", "image_std") if name in given}
        settings = {name: value for name, value in defaults.items() if "pixels" not in name} | settings
        return cls(**settings, timed=timed).with_overrides(bounds | dict(overrides or {}))

    def with_overrides(self, overrides: Mapping[str, Any]) -> VideoProcessing:
        """These settings with `overrides` over them; ValueError naming any key not taken or value not allowed."""
        if unknown := sorted(set(overrides) - set(OVERRIDES)):
            raise ValueError(f"a video takes no {', '.join(unknown)} (only {', '.join(OVERRIDES)})")
        for name, value in overrides.items():
            if type(value) is not int or not (value > 0 or (name == "num_frames" and value == -1)):  # bool is no int
                raise ValueError(f"{name} must be a positive integer{' or -1' * (name == 'num_frames')}, "
                                 f"got {value!r}")
        return replace(self, **overrides)

    def with_request_kwargs(self, kwargs: Mapping[str, Any]) -> VideoProcessing:
        """These settings with a request's (or --mm-processor-kwargs') over them, as vLLM hands them to the model's
        processor, which gives its video processor those it takes too: `fps` samples the whole video at that rate,
        `do_sample_frames` false keeps every frame loaded (all of them, or --media-io-kwargs' num_frames); size's
        shortest_edge and longest_edge (and Qwen2VLVideoProcessor's min_pixels and max_pixels, which
        Qwen3VLVideoProcessor has not) bound its pixels, as they bound an image's."""
        size = kwargs.get("size") or {}
        bounds = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
        if not self.timed:
            bounds = {name: kwargs.get(name, value) for name, value in bounds.items()}
        changes: dict[str, Any] = {name: value for name, value in bounds.items() if value is not None}
        if kwargs.get("do_sample_frames") is False:
            changes["num_frames"] = self.num_frames if self.num_frames is not None else -1
        elif "fps" in kwargs:
            changes |= {"fps": float(kwargs["fps"]), "num_frames": None}
        return replace(self, **changes) if changes else self

    def sampled_indices(self, total_frames: int, fps: float) -> list[int]:
        """The frames kept of `total_frames` at `fps`: `num_frames` spread evenly from the first to the last,
        truncated to whole frames (every frame where there are no more, or for -1), as vLLM's OpenCV loader keeps
        them; else Qwen's rate, as Qwen2VLVideoProcessor.sample_frames and vLLM's Qwen-VL loader keep them (Qwen3-VL's
        processor's: the frames rounded to the nearest, not in whole pairs)."""
        if self.num_frames is not None:
            if self.num_frames == -1 or total_frames <= self.num_frames:
                return list(range(total_frames))
            return np.linspace(0, total_frames - 1, self.num_frames, dtype=int).tolist()
        if self.timed:
            wanted = min(max(int(total_frames / fps * self.fps), self.min_frames), self.max_frames, total_frames)
            return np.linspace(0, total_frames - 1, wanted).round().astype(int).tolist()
        import torch  # noqa: PLC0415 (only a video model's gateway loads it)

        pair = self.temporal_patch_size
        most = math.floor(min(self.max_frames, total_frames) / pair) * pair
        wanted = min(max(total_frames / fps * self.fps, self.min_frames), most, total_frames)
        wanted = math.floor(wanted / pair) * pair
        if not wanted:
            raise ValueError(f"a video of {total_frames} frame(s) is too short: its frames go in pairs")
        # Its float steps, as the processor takes them (torch's float32 arange).
        return torch.arange(0, total_frames, total_frames / wanted).int().clamp(max=total_frames - 1).tolist()

    def resized_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """(height, width) of `num_frames` frames of that size once resized; ValueError for one over 200 times as
        long as it is wide, as transformers refuses it (or for fewer frames than a pair, as Qwen3-VL's does)."""
        factor = self.patch_size * self.merge_size
        if self.timed:
            return _whole_video_resize(num_frames, height, width, self.temporal_patch_size, factor, self.min_pixels,
                                       self.max_pixels)
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"a video of {width}x{height} pixels: its aspect ratio must be under 200")
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def frames_after_padding(self, num_frames: int) -> int:
        """`num_frames` rounded up to whole temporal patches, as the processor pads them."""
        return num_frames + -num_frames % self.temporal_patch_size

    def num_bytes(self, height: int, width: int, num_frames: int) -> int:
        """The bytes of `num_frames` frames of height x width once resized and padded: to refuse before any are made."""
        resized_height, resized_width = self.resized_size(height, width, num_frames)
        return self.frames_after_padding(num_frames) * resized_height * resized_width * 3


# Qwen3VLVideoProcessor's, where its settings leave them out.
QWEN3_VL_DEFAULTS = {"min_pixels": 128 * 32 * 32, "max_pixels": 32 * 32 * 768, "patch_size": 16,
                     "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5)}


def _whole_video_resize(num_frames: int, height: int, width: int, pair: int, factor: int, min_pixels: int,
                        max_pixels: int) -> tuple[int, int]:
    """Qwen3VLVideoProcessor's smart resize: each side to whole `factor`s (a side under one scaled up to it first),
    the whole video's pixels (its frames rounded to whole pairs) kept within [min_pixels, max_pixels]."""
    if num_frames < pair:
        raise ValueError(f"a video of {num_frames} frame(s) is too short: its frames go in pairs")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video of {width}x{height} pixels: its aspect ratio must be under 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / pair) * pair
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _video_processor_config(model_dir: Path) -> dict:
    """The video processor's settings as transformers' AutoVideoProcessor finds them: processor_config.json's
    `video_processor` (transformers 5 saves it so), else video_preprocessor_config.json, else the image
    processor's preprocessor_config.json (all a released Qwen2-VL or Qwen2.5-VL has)."""
    processor = model_dir / "processor_config.json"
    if processor.is_file() and isinstance(nested := json.loads(processor.read_text()).get("video_processor"), dict):
        return nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (model_dir / name).is_file():
            return json.loads((model_dir / name).read_text())
    raise ValueError(f"{model_dir}: no video processor's settings (processor_config.json's video_processor, "
                     "video_preprocessor_config.json or preprocessor_config.json)")
