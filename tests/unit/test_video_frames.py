"""A chat's video as a Qwen2-VL / Qwen2.5-VL worker takes it: frames sampled as vLLM's default loader samples them,
decoded exactly (lossless test videos made here), resized as transformers' Qwen2VLVideoProcessor resizes them, and
its settings read from a model dir as transformers reads them."""
from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import torch

from services.gateway import video_frames
from services.gateway.errors import APIError
from services.gateway.video_frames import VideoFrames, VideoTooLarge, processed_video, read_video
from services.gateway.video_processing import VideoProcessing
from tests.services.gateway.image_chats import encoded_video as encoded

av = pytest.importorskip("av")

# A released Qwen2.5-VL's preprocessor_config.json (its only processor file): its images' pixel bounds, top level.
QWEN2_5_VL = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
              "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}


def frames_of(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [T, H, W, 3], every frame different."""
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def vllms_indices(total_frames: int, num_frames: int) -> list[int]:
    """vLLM's VideoBackend.compute_frames_index_to_sample (vllm/multimodal/video.py) with fps unset."""
    count = max(1, min(num_frames, total_frames) if num_frames > 0 else total_frames)
    if count == total_frames:
        return list(range(total_frames))
    return np.linspace(0, total_frames - 1, count, dtype=int).tolist()


def qwens_indices(total_frames: int, fps: float) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames at 2 frames a second, at least 4 and at most 768 (vLLM's Qwen-VL
    loader's), written out here: that processor's module needs torchvision."""
    most = total_frames if total_frames < 768 else 768
    wanted = min(max(total_frames / fps * 2, 4), most // 2 * 2, total_frames) // 2 * 2
    return torch.arange(0, total_frames, total_frames / wanted).int().tolist()


# Frames kept at their size: whole 2-pixel "tokens" within wide bounds.
AS_THEY_ARE = VideoProcessing(patch_size=2, merge_size=1, min_pixels=4, max_pixels=2**24)


@pytest.mark.parametrize("total_frames", [1, 2, 37, 1000])
@pytest.mark.parametrize("num_frames", [-1, 1, 2, 5, 32, 36, 37, 38, 100])
def test_num_frames_are_sampled_as_vllms_loader_samples_them(total_frames, num_frames):
    processing = VideoProcessing(num_frames=num_frames)
    assert processing.sampled_indices(total_frames, 30.0) == vllms_indices(total_frames, num_frames)


def test_num_frames_spread_from_the_first_frame_to_the_last():
    assert VideoProcessing(num_frames=5).sampled_indices(37, 10.0) == [0, 9, 18, 27, 36]
    assert VideoProcessing(num_frames=4).sampled_indices(10, 1.0) == [0, 3, 6, 9]


@pytest.mark.parametrize("total_frames, fps", [(37, 10.0), (300, 30.0), (90, 29.97), (7, 25.0), (4, 1.0),
                                               (10_000, 24.0), (3, 30.0), (451, 29.97)])
def test_by_default_frames_are_sampled_at_two_a_second_as_qwens_processor_samples_them(total_frames, fps):
    assert VideoProcessing().sampled_indices(total_frames, fps) == qwens_indices(total_frames, fps)


def test_two_a_second_keeps_at_least_four_and_pairs():
    processing = VideoProcessing()
    assert processing.sampled_indices(37, 10.0) == [0, 6, 12, 18, 24, 30]  # 7.4 frames asked, 6 kept
    assert processing.sampled_indices(100, 60.0) == [0, 25, 50, 75]  # 3.3 asked: the least, 4
    assert len(processing.sampled_indices(100_000, 30.0)) == 768
    with pytest.raises(ValueError, match="too short"):
        processing.sampled_indices(1, 30.0)


@pytest.mark.parametrize("container, codec, pix_fmt", [("matroska", "ffv1", "bgr0"),  # keeps no frame count
                                                       ("mov", "qtrle", "rgb24")])  # counts its frames
@pytest.mark.parametrize("height, width", [(48, 64), (50, 90)])
def test_read_frames_are_the_sampled_frames_encoded(container, codec, pix_fmt, height, width):
    source = frames_of(37, height, width)
    data = encoded(source, fps=10, codec=codec, pix_fmt=pix_fmt, container=container)
    for num_frames in (5, 32, 37, 40, -1, None):
        processing = AS_THEY_ARE.with_overrides({"num_frames": num_frames} if num_frames else {})
        video = read_video(processing, data)
        expected = vllms_indices(37, num_frames) if num_frames else qwens_indices(37, 10.0)
        assert video.indices == tuple(expected)
        padded = len(expected) + len(expected) % 2
        assert video.frames.dtype == np.uint8 and video.frames.shape == (padded, height, width, 3)
        np.testing.assert_array_equal(video.frames[:len(expected)], source[expected])
        assert (video.frames[len(expected):] == source[expected[-1]]).all()  # the last repeated to a whole pair
        assert (video.total_frames, video.fps) == (37, 10.0)
        assert video.sampled_fps == pytest.approx(len(video.indices) / 37 * 10)


def shown_turned(data: bytes, matrix: tuple[int, ...]) -> bytes:
    """A QuickTime/MP4 file's video track shown through `matrix` (its track header's display matrix: how a phone
    marks a portrait video)."""
    turned = bytearray(data)
    box = turned.find(b"tkhd") - 4
    assert turned[box + 8] == 0  # a version 0 header: its matrix 48 bytes in
    turned[box + 48:box + 84] = struct.pack(">9i", *matrix, 0, 0, 1 << 30)
    return bytes(turned)


CLOCKWISE, ANTICLOCKWISE, UPSIDE_DOWN = (0, 1 << 16, -(1 << 16), 0), (0, -(1 << 16), 1 << 16, 0), \
    (-(1 << 16), 0, 0, -(1 << 16))


@pytest.mark.parametrize("matrix, turns", [(CLOCKWISE, -1), (ANTICLOCKWISE, 1), (UPSIDE_DOWN, 2)])
def test_a_video_shown_turned_is_read_as_it_is_shown(matrix, turns):
    """As vLLM's OpenCV loader reads it (its display matrix applied): a portrait phone video comes upright, its
    sides swapped."""
    source = frames_of(6, 32, 64)
    data = shown_turned(encoded(source, codec="qtrle", pix_fmt="rgb24", container="mov"),
                        (matrix[0], matrix[1], 0, matrix[2], matrix[3], 0))
    frames = read_video(AS_THEY_ARE.with_overrides({"num_frames": -1}), data).frames
    np.testing.assert_array_equal(frames, np.rot90(source, k=turns, axes=(1, 2)))


def test_a_lossy_mp4_decodes():
    gradient = np.linspace(0, 255, 64 * 48 * 3).reshape(48, 64, 3)
    source = np.stack([np.roll(gradient, shift, axis=1) for shift in range(37)]).astype(np.uint8)
    data = encoded(source, fps=30, codec="libx264", pix_fmt="yuv420p", container="mp4")
    video = read_video(AS_THEY_ARE.with_overrides({"num_frames": 8}), data)
    assert video.indices == (0, 5, 10, 15, 20, 25, 30, 36) and (video.total_frames, video.fps) == (37, 30.0)
    assert np.abs(video.frames.astype(int) - source[list(video.indices)]).mean() < 8
    assert video.sampled_fps == pytest.approx(8 / 37 * 30)


def test_sampled_fps_is_transformers_video_metadatas():
    from transformers.video_utils import VideoMetadata

    video = VideoFrames(np.zeros((4, 2, 2, 3), np.uint8), fps=29.97, total_frames=451, indices=(0, 225, 450))
    assert video.sampled_fps == VideoMetadata(total_num_frames=451, fps=29.97, frames_indices=[0, 225, 450]).sampled_fps


SIZES = [(48, 64), (50, 90), (1080, 1920), (720, 1280), (28, 28), (1, 56), (360, 640), (4000, 30), (3000, 4000),
         (123, 457)]
BOUNDS = [{}, {"min_pixels": 3136, "max_pixels": 12845056}, {"min_pixels": 256 * 28 * 28, "max_pixels": 256 * 28 * 28},
          {"max_pixels": 64 * 28 * 28}]


@pytest.mark.parametrize("bounds", BOUNDS)
def test_resized_size_is_transformers_smart_resize(bounds):
    # The video processor's smart_resize is "Copied from" this one, whose module imports without torchvision.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    processing = VideoProcessing().with_overrides(bounds)
    for height, width in SIZES:
        assert processing.resized_size(height, width, 8) == smart_resize(
            height, width, 28, min_pixels=processing.min_pixels, max_pixels=processing.max_pixels)


def test_a_frame_over_200_times_as_long_as_it_is_wide_is_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        VideoProcessing().resized_size(2, 500, 4)


QWEN3_VL = VideoProcessing(timed=True, patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                           image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


@pytest.mark.parametrize("total_frames, fps", [(37, 10.0), (300, 30.0), (90, 29.97), (7, 25.0), (4, 1.0),
                                               (10_000, 24.0), (3, 30.0), (1, 30.0), (451, 29.97)])
def test_qwen3_vls_frames_are_sampled_as_its_processor_samples_them(total_frames, fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    theirs = Qwen3VLVideoProcessor().sample_frames(VideoMetadata(total_num_frames=total_frames, fps=fps)).tolist()
    assert QWEN3_VL.sampled_indices(total_frames, fps) == theirs


@pytest.mark.parametrize("num_frames", [2, 3, 8, 64, 768])
def test_qwen3_vls_frames_are_resized_within_the_whole_videos_bounds(num_frames):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    for height, width in [*SIZES, (20, 40), (10, 3000)]:
        for bounds in ({}, {"max_pixels": 4096 * 64}, {"min_pixels": 2**22, "max_pixels": 2**24}):
            processing = QWEN3_VL.with_overrides(bounds)
            try:
                theirs = smart_resize(num_frames, height, width, 2, 32, processing.min_pixels, processing.max_pixels)
            except ValueError:
                with pytest.raises(ValueError):
                    processing.resized_size(height, width, num_frames)
                continue
            assert processing.resized_size(height, width, num_frames) == theirs, (height, width, bounds)


def test_qwen3_vls_frame_pairs_times_are_its_processors():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for indices, fps in [((0, 6, 12, 18, 24, 30, 36), 10.0), ((0, 15, 30, 45), 29.97), ((3,), 1.0)]:
        video = VideoFrames(np.zeros((1, 1, 1, 3), np.uint8), fps, 100, indices)
        assert list(video.pair_times(2)) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


def test_a_qwen3_vl_video_goes_with_its_frame_pairs_times():
    data = encoded(frames_of(37, 64, 96), fps=10)
    video = processed_video(QWEN3_VL, data, None, "messages")
    assert video.size.frames == 8 and video.size.times == (0.3, 1.5, 2.7, 3.6)  # frames 0, 6, ... 36, and 36 again
    # 8 frames of 64x96 are fewer pixels than its least: scaled up
    assert (video.size.height, video.size.width) == QWEN3_VL.resized_size(64, 96, 7) == (128, 192)
    assert processed_video(VideoProcessing(), data, None, "messages").size.times == ()  # Qwen2-VL's write none


@pytest.mark.parametrize("bounds", [{"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 4},  # 50x90 down to 28x56
                                    {"min_pixels": 128 * 28 * 28, "max_pixels": 28 * 28 * 768}])  # up to 252x448
def test_read_frames_are_resized_by_torchvisions_bicubic_on_uint8(bounds):
    processing = VideoProcessing(num_frames=-1).with_overrides(bounds)
    source = frames_of(5, 50, 90)
    resized = read_video(processing, encoded(source)).frames
    height, width = processing.resized_size(50, 90, 5)
    assert resized.shape == (6, height, width, 3) and resized.dtype == np.uint8 and resized.flags.c_contiguous
    pixels = torch.from_numpy(source).permute(0, 3, 1, 2).contiguous()
    # torchvision's resize_image, for a uint8 CPU tensor and BICUBIC: torch's uint8 kernel on it as it is.
    expected = torch.nn.functional.interpolate(pixels, size=[height, width], mode="bicubic", align_corners=False,
                                               antialias=True).permute(0, 2, 3, 1).numpy()
    np.testing.assert_array_equal(resized[:5], expected)
    np.testing.assert_array_equal(resized[5], expected[4])
    # Not the float route (torchvision's on CUDA): the uint8 kernel clamps between its two passes, and noise
    # overshoots there.
    floats = torch.nn.functional.interpolate(pixels.float(), size=[height, width], mode="bicubic",
                                             align_corners=False, antialias=True).round_().clamp_(0, 255)
    assert np.abs(resized[:5].astype(int) - floats.permute(0, 2, 3, 1).numpy()).max() > 1


def test_read_frames_are_transformers_video_processors():
    """Bit for bit against Qwen2VLVideoProcessor, where torchvision imports (not in CI: PyPI's wheel is a CUDA
    build whose C ops do not load with a CPU torch)."""
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    except (ImportError, RuntimeError):
        pytest.skip("torchvision does not import")
    for bounds, (height, width), num_frames in [({"min_pixels": 3136, "max_pixels": 28 * 28 * 4}, (50, 90), 5),
                                                ({}, (48, 64), 4), ({}, (50, 90), 7), ({}, (56, 112), 3)]:
        processing = VideoProcessing(num_frames=-1).with_overrides(bounds)
        source = frames_of(num_frames, height, width)
        ours = torch.from_numpy(read_video(processing, encoded(source)).frames).permute(0, 3, 1, 2)[None].float()
        reference = Qwen2VLVideoProcessor(min_pixels=processing.min_pixels, max_pixels=processing.max_pixels)
        theirs = reference(videos=[source], do_rescale=False, do_normalize=False, cap_pixels_per_frame=False,
                           return_tensors="pt")
        patches, *grid = reference.patchify(ours, patch_size=14, merge_size=2, temporal_patch_size=2)
        assert grid == theirs["video_grid_thw"][0].tolist()
        torch.testing.assert_close(patches[0], theirs["pixel_values_videos"].float(), rtol=0, atol=0)


@pytest.mark.parametrize("num_frames, padded", [(1, 2), (4, 4), (5, 6)])
def test_frames_are_padded_to_whole_temporal_patches_by_the_last(num_frames, padded):
    processing = VideoProcessing(min_pixels=28 * 56, num_frames=-1)
    source = frames_of(num_frames, 28, 56)
    frames = read_video(processing, encoded(source)).frames  # 28x56: whole tokens within bounds, kept as it is
    assert processing.frames_after_padding(num_frames) == padded == len(frames)
    np.testing.assert_array_equal(frames[:num_frames], source)
    assert (frames[num_frames:] == source[-1]).all()
    assert processing.num_bytes(28, 56, num_frames) == frames.nbytes


def test_frames_past_a_messages_bytes_are_refused_before_any_is_made():
    processing = VideoProcessing(num_frames=3)
    data = encoded(frames_of(3, 50, 90))
    assert processing.num_bytes(50, 90, 3) == read_video(processing, data).frames.nbytes == 4 * 252 * 448 * 3
    with pytest.raises(VideoTooLarge, match="3 frames take 1.3 MiB"):
        read_video(processing, data, max_bytes=2**20)
    with pytest.raises(APIError, match="--media-io-kwargs") as refused:
        processed_video(processing, data, 2**20, "messages")
    assert refused.value.status == 413
    with pytest.raises(APIError, match="could not be decoded") as refused:
        processed_video(processing, b"not a video", 2**20, "messages")
    assert refused.value.status == 400
    video = processed_video(processing, data, 2**30, "messages")
    assert (video.meta.frames, video.meta.height, video.meta.width) == (4, 252, 448)
    assert video.meta.fps == pytest.approx(3 / 3 * 10) and len(video.rgb) == 4 * 252 * 448 * 3


def audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as output:
        stream = output.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        output.mux(stream.encode(frame))
        output.mux(stream.encode())
    return buffer.getvalue()


@pytest.mark.parametrize("data, message", [(b"", "could not be decoded"),
                                           (b"not a video" * 100, "could not be decoded"),
                                           (audio_only(), "no video stream")])
def test_bytes_that_are_no_video_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        read_video(VideoProcessing(), data)


def test_a_concat_list_among_the_bytes_opens_no_file(tmp_path, monkeypatch):
    (tmp_path / "secret.mkv").write_bytes(encoded(frames_of(3, 16, 16)))
    monkeypatch.chdir(tmp_path)  # FFmpeg's concat demuxer opens a relative name from here where protocols are allowed
    with pytest.raises(ValueError, match="could not be decoded"):
        read_video(VideoProcessing(), b"ffconcat version 1.0\nfile secret.mkv\n")


def test_videos_past_the_bounds_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="8192"):
        read_video(VideoProcessing(), encoded(np.zeros((1, 8, 8200, 3), np.uint8)))
    monkeypatch.setattr(video_frames, "MOST_FRAMES", 36)
    for container, codec, pix_fmt in [("matroska", "ffv1", "bgr0"), ("mov", "qtrle", "rgb24")]:
        data = encoded(frames_of(37, 16, 16), codec=codec, pix_fmt=pix_fmt, container=container)
        with pytest.raises(ValueError, match="more than 36 frames"):
            read_video(VideoProcessing(num_frames=4), data)


def write_json(path, config):
    path.write_text(json.dumps(config))


def test_a_released_qwen2_5_vl_dir_gives_its_images_bounds_to_videos(tmp_path):
    from transformers.video_processing_utils import BaseVideoProcessor

    write_json(tmp_path / "preprocessor_config.json", QWEN2_5_VL)
    write_json(tmp_path / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})
    assert BaseVideoProcessor.get_video_processor_dict(str(tmp_path))[0] == QWEN2_5_VL  # what transformers reads
    processing = VideoProcessing.from_dir(tmp_path)
    assert processing == VideoProcessing(min_pixels=3136, max_pixels=12845056)
    assert VideoProcessing.from_dir(tmp_path, {"num_frames": 8, "max_pixels": 602112}) == VideoProcessing(
        min_pixels=3136, max_pixels=602112, num_frames=8)


def test_the_video_processors_own_settings_come_first(tmp_path):
    from transformers.video_processing_utils import BaseVideoProcessor

    write_json(tmp_path / "preprocessor_config.json", QWEN2_5_VL)
    video = {"size": {"shortest_edge": 4096, "longest_edge": 65536}, "temporal_patch_size": 2,
             "video_processor_type": "Qwen2VLVideoProcessor"}
    write_json(tmp_path / "video_preprocessor_config.json", video)
    assert BaseVideoProcessor.get_video_processor_dict(str(tmp_path))[0] == video
    assert VideoProcessing.from_dir(tmp_path) == VideoProcessing(min_pixels=4096, max_pixels=65536)
    nested = {"size": {"shortest_edge": 1024, "longest_edge": 4096}, "max_pixels": 8192, "image_mean": [0.5] * 3,
              "image_std": [0.5] * 3, "rescale_factor": 0.5}
    write_json(tmp_path / "processor_config.json", {"video_processor": nested, "image_processor": QWEN2_5_VL})
    assert BaseVideoProcessor.get_video_processor_dict(str(tmp_path))[0] == nested
    assert VideoProcessing.from_dir(tmp_path) == VideoProcessing(
        min_pixels=1024, max_pixels=8192, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, rescale_factor=0.5)


def test_a_dir_without_pixel_bounds_takes_the_processors_defaults(tmp_path):
    write_json(tmp_path / "video_preprocessor_config.json", {"patch_size": 14})
    assert VideoProcessing.from_dir(tmp_path) == VideoProcessing(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)


@pytest.mark.parametrize("config, message", [(None, "no video processor's settings"),
                                             ({"size": {"height": 224, "width": 224}}, "no min_pixels or max_pixels"),
                                             ({"resample": 2}, "bicubic"), ({"cap_pixels_per_frame": True}, "cap")])
def test_settings_not_followed_are_refused(tmp_path, config, message):
    if config is not None:
        write_json(tmp_path / "preprocessor_config.json", config)
    with pytest.raises(ValueError, match=message):
        VideoProcessing.from_dir(tmp_path)


@pytest.mark.parametrize("overrides, message", [({"fps": 2}, "takes no fps"), ({"num_frames": 0}, "num_frames"),
                                                ({"num_frames": -2}, "num_frames"), ({"num_frames": "8"}, "num_frames"),
                                                ({"num_frames": True}, "num_frames"), ({"min_pixels": 0}, "min_pixels"),
                                                ({"max_pixels": 1.5e6}, "max_pixels"), ({"size": {}}, "takes no size")])
def test_overrides_not_taken_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        VideoProcessing().with_overrides(overrides)


def test_every_frame_is_sampled_with_num_frames_minus_one():
    assert VideoProcessing().with_overrides({"num_frames": -1}).num_frames == -1


def test_a_requests_sampling_over_the_processors():
    """vLLM's mm_processor_kwargs for a video, as its processor takes them."""
    processing = VideoProcessing()
    assert processing.with_request_kwargs({"fps": 1}) == VideoProcessing(fps=1.0)
    assert processing.with_request_kwargs({"do_sample_frames": False}).num_frames == -1  # every frame
    assert processing.with_request_kwargs({"do_sample_frames": True, "max_patches": 4}) is processing
    spread = VideoProcessing(num_frames=8)
    assert spread.with_request_kwargs({"do_sample_frames": False}).num_frames == 8  # those loaded
    assert spread.with_request_kwargs({"fps": 1}).num_frames is None  # the whole video at that rate


def test_a_requests_pixel_bounds_bound_its_videos_too():
    """transformers' processors hand min_pixels and max_pixels (Qwen2-VL's) and size's edges to their video
    processor as well as their image processor; Qwen3VLVideoProcessor takes only size."""
    processing = VideoProcessing()
    assert processing.with_request_kwargs({"max_pixels": 64 * 28 * 28}).max_pixels == 64 * 28 * 28
    assert processing.with_request_kwargs({"size": {"shortest_edge": 4096, "longest_edge": 65536}}) == \
        VideoProcessing(min_pixels=4096, max_pixels=65536)
    assert QWEN3_VL.with_request_kwargs({"max_pixels": 64 * 28 * 28}) is QWEN3_VL
    assert QWEN3_VL.with_request_kwargs({"size": {"longest_edge": 2**20}}).max_pixels == 2**20
