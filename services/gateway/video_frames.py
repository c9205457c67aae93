"""A chat's video (an mp4, webm, mkv... file's bytes) as a Qwen-VL worker takes it: decoded by FFmpeg's libraries
(PyAV), the frames its model's video processor keeps (video_processing.py) each resized as it is decoded as
transformers' video processor resizes them (torchvision's antialiased bicubic on uint8), turned as the video is shown,
then padded to a whole number of temporal patches; Qwen3-VL's with each frame pair's time, which its prompt writes.
PyAV and torch are imported only when a video is read: a text model's gateway never loads them."""
from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from services.gateway.errors import APIError
from services.gateway.given_embeddings import ProcessedImage
from services.gateway.video_processing import VideoProcessing

MOST_SIDE = 8192  # pixels, of a video's frames
MOST_FRAMES = 100_000  # of a video, sampled or not: each up to the last sampled one is decoded


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


class VideoTooLarge(ValueError):
    """Frames that would pass what a message to a worker carries."""


def processed_video(processing: VideoProcessing, data: bytes, max_bytes: int | None, param: str) -> ProcessedImage:
    """The video `data` holds, as the workers take it, made by `processing`; APIError naming `param`: 400 for bytes
    that are no video read here, 413 where its frames would pass `max_bytes` (a message to a worker), before they
    are made."""
    try:
        video = read_video(processing, data, max_bytes)
    except VideoTooLarge as e:
        raise APIError(413, f"{param}: {e}: send a shorter or smaller video, sample fewer frames (mm_processor_"
                            "kwargs' fps, --media-io-kwargs' num_frames) or bound them (max_pixels)",
                       param=param) from None
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
    frames, height, width, channels = video.frames.shape
    image = ProcessedImage.of(video.frames.tobytes(), (height, width, channels), processing.rescale_factor,
                              processing.image_mean, processing.image_std, frames=frames, fps=video.sampled_fps)
    return replace(image, times=video.pair_times(processing.temporal_patch_size)) if processing.timed else image


def read_video(processing: VideoProcessing, data: bytes, max_bytes: int | None = None) -> VideoFrames:
    """The frames of `data`'s video stream (FFmpeg's best, as OpenCV's) at `processing`'s sampled indices, in RGB, each
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
            indices = processing.sampled_indices(total_frames, fps)
            size = processing.num_bytes(stream.height, stream.width, len(indices))
            if max_bytes is not None and size > max_bytes:
                raise VideoTooLarge(f"its {len(indices)} frames take {size / 2**20:.1f} MiB as the model's video "
                                    "processor makes them, more than a message to a worker carries "
                                    f"({max_bytes / 2**20:.1f} MiB, --max-message-bytes)")
            frames, kept = _decoded(processing, container, stream, indices)
    except av.FFmpegError as error:  # also a ValueError: said without FFmpeg's error number
        raise ValueError(f"the video could not be decoded: {error.strerror}") from None
    return VideoFrames(frames, fps, total_frames, kept)


def _decoded(processing: VideoProcessing, container, stream, indices: list[int]) -> tuple[np.ndarray, tuple[int, ...]]:
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
                height, width = processing.resized_size(*rgb.shape[:2], len(indices))
                frames = np.empty((processing.frames_after_padding(len(indices)), height, width, 3), dtype=np.uint8)
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
    frames = frames[:processing.frames_after_padding(len(kept))]
    frames[len(kept):] = frames[len(kept) - 1]  # the last frame repeated, as the processor pads
    return frames, tuple(kept)


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
