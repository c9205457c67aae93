"""A chat's video (an mp4, webm, mkv... file's bytes) as a Qwen-VL worker takes it: decoded by FFmpeg's libraries
(PyAV), frames sampled as vLLM samples these models' videos (Qwen's 2 frames a second, at least 4 and at most 768;
or, where --media-io-kwargs gives num_frames, that many spread evenly from the first frame to the last, as vLLM's
OpenCV loader spreads them), each resized as it is decoded as transformers' Qwen2VLVideoProcessor resizes them (smart
resize within the processor's pixel bounds, torchvision's antialiased bicubic on uint8; Qwen3VLVideoProcessor's
bounds are the whole video's), then padded to a whole number of temporal patches; Qwen3-VL's with each frame pair's
time, which its prompt writes. PyAV and torch are imported only when a video is read: a text model's gateway
never loads them."""
from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from services.gateway.errors import APIError
from services.gateway.given_embeddings import ProcessedImage
from services.gateway.image_processing import smart_resize

MOST_SIDE = 8192  # pixels, of a video's frames
MOST_FRAMES = 100_000  # of a video, sampled or not: each up to the last sampled one is decoded
OVERRIDES = ("num_frames", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class VideoFrames:
    """A video's sampled frames as the processor makes them, and what Qwen2.5-VL's processor reads of its metadata
    (transformers' VideoMetadata)."""

    frames: np.ndarray  # uint8 [T', h, w, 3], RGB, resized, T' whole temporal patches (the last frame repeated)
    fps: float  # the source's average frame rate
    total_frames: int
    indices: tuple[int, ...]  # of the sampled frames among the source's

    @property
    def sampled_fps(self) -> float:
        """The sampled frames' rate: Qwen2.5-VL spaces its temporal positions by temporal_patch_size / this."""
        return len(self.indices) / self.total_frames * self.fps

    def pair_times(self, pair: int) -> tuple[float, ...]:
        """Each frame pair's time in seconds, the mean of its first and last frame's (Qwen3VLProcessor's
        _calculate_timestamps: the last frame repeated to whole pairs)."""
        indices = [*self.indices, *[self.indices[-1]] * (-len(self.indices) % pair)]
        times = [index / self.fps for index in indices]
        return tuple((times[i] + times[i + pair - 1]) / 2 for i in range(0, len(times), pair))


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

    def processed(self, data: bytes, max_bytes: int | None, param: str) -> ProcessedImage:
        """The video `data` holds, as the workers take it; APIError naming `param`: 400 for bytes that are no video
        read here, 413 where its frames would pass `max_bytes` (a message to a worker), before they are made."""
        try:
            video = self.read(data, max_bytes)
        except VideoTooLarge as e:
            raise APIError(413, f"{param}: {e}: send a shorter or smaller video, sample fewer frames (mm_processor_"
                                "kwargs' fps, --media-io-kwargs' num_frames) or bound them (max_pixels)",
                           param=param) from None
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        frames, height, width, channels = video.frames.shape
        image = ProcessedImage.of(video.frames.tobytes(), (height, width, channels), self.rescale_factor,
                                  self.image_mean, self.image_std, frames=frames, fps=video.sampled_fps)
        return replace(image, times=video.pair_times(self.temporal_patch_size)) if self.timed else image

    def read(self, data: bytes, max_bytes: int | None = None) -> VideoFrames:
        """The frames of `data`'s video stream (FFmpeg's best, as OpenCV's) at `sampled_indices`, in RGB, each
        resized as it is decoded (no more than one frame at its own size held), padded; ValueError for bytes that
        are no video FFmpeg decodes, one without frames, or one past MOST_SIDE or MOST_FRAMES, VideoTooLarge for
        frames past `max_bytes`."""
        import av  # noqa: PLC0415 (only a video model's gateway loads FFmpeg)

        try:
            total_frames = _num_frames(av, data)
            with _video_stream(av, data) as (container, stream):
                fps = float(stream.average_rate or stream.guessed_rate or 0)  # OpenCV's CAP_PROP_FPS, as vLLM's
                if fps <= 0:
                    raise ValueError("the video has no frame rate")
                indices = self.sampled_indices(total_frames, fps)
                size = self.num_bytes(stream.height, stream.width, len(indices))
                if max_bytes is not None and size > max_bytes:
                    raise VideoTooLarge(f"its {len(indices)} frames take {size / 2**20:.1f} MiB as the model's video "
                                        "processor makes them, more than a message to a worker carries "
                                        f"({max_bytes / 2**20:.1f} MiB, --max-message-bytes)")
                frames, kept = self._decoded(container, stream, indices)
        except av.FFmpegError as error:  # also a ValueError: said without FFmpeg's error number
            raise ValueError(f"the video could not be decoded: {error.strerror}") from None
        return VideoFrames(frames, fps, total_frames, kept)

    def _decoded(self, container, stream, indices: list[int]) -> tuple[np.ndarray, tuple[int, ...]]:
        """The frames at `indices` resized into one array, padded; the indices there were (a header may count
        frames that are not there: those past the end are left out, as vLLM leaves them)."""
        import torch  # noqa: PLC0415

        frames: np.ndarray | None = None
        wanted, kept = set(indices), []
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                if (frame.height, frame.width) != (stream.height, stream.width):
                    raise ValueError(f"a video's frames must keep one size ({stream.width}x{stream.height}), got "
                                     f"{frame.width}x{frame.height}")
                # Turned as it is shown (its display matrix: a phone's portrait video), as vLLM's OpenCV turns it.
                rgb = np.ascontiguousarray(np.rot90(frame.to_ndarray(format="rgb24"), k=round(frame.rotation / 90)))
                if frames is None:  # a turned video's sides swapped (its pixels, and so its bytes, the same)
                    height, width = self.resized_size(*rgb.shape[:2], len(indices))
                    frames = np.empty((self.frames_after_padding(len(indices)), height, width, 3), dtype=np.uint8)
                # [1, 3, H, W] uint8, as transformers lays a frame out before resizing it
                pixels = torch.from_numpy(rgb).permute(2, 0, 1)[None]
                if (height, width) != rgb.shape[:2]:  # torchvision returns a same-size frame as it is
                    # torchvision's resize of a uint8 CPU tensor with BICUBIC: torch's own uint8 kernel, never in float
                    pixels = torch.nn.functional.interpolate(pixels, size=[height, width], mode="bicubic",
                                                             align_corners=False, antialias=True)
                frames[len(kept)] = pixels[0].permute(1, 2, 0).numpy()
                kept.append(index)
            if index >= indices[-1]:
                break
        if frames is None:
            raise ValueError("the video has no frames")
        frames = frames[:self.frames_after_padding(len(kept))]
        frames[len(kept):] = frames[len(kept) - 1]  # the last frame repeated, as the processor pads
        return frames, tuple(kept)


class VideoTooLarge(ValueError):
    """Frames that would pass what a message to a worker carries."""


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


def _num_frames(av, data: bytes) -> int:
    """The container's frame count; where it has none (Matroska and WebM keep none), the frames decoded. vLLM's
    OpenCV estimates it there from the duration and frame rate, the same for a constant rate: counting holds where
    an estimate would sample past the last frame."""
    with _video_stream(av, data) as (container, stream):
        total_frames = stream.frames
        if not total_frames:
            for total_frames, _ in enumerate(container.decode(stream), start=1):
                if total_frames > MOST_FRAMES:
                    break
    if not total_frames:
        raise ValueError("the video has no frames")
    if total_frames > MOST_FRAMES:
        raise ValueError(f"a video of more than {MOST_FRAMES} frames is not served")
    return total_frames


@contextmanager
def _video_stream(av, data: bytes) -> Iterator[tuple[Any, Any]]:
    # No protocol at all: the bytes come through Python, and a concat list or playlist among them must not open
    # files or URLs.
    with av.open(io.BytesIO(data), container_options={"protocol_whitelist": "none"}) as container:
        stream = container.streams.best("video")
        if stream is None:
            raise ValueError("the file has no video stream")
        if max(stream.width, stream.height) > MOST_SIDE or not stream.width or not stream.height:
            raise ValueError(f"a video of {stream.width}x{stream.height} pixels is not served: at most {MOST_SIDE} "
                             "on a side")
        stream.thread_type = "AUTO"  # frames decoded on threads, in order all the same
        yield container, stream


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
