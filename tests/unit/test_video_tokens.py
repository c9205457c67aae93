"""How a Qwen-VL prompt holds a video, as transformers' Qwen2-VL and Qwen2.5-VL processors expand the template's
<|video_pad|> mark: one run of a token a square of each frame pair, beside images' runs in the prompt's order; and
where the tokenizer refuses one."""
from __future__ import annotations

import pytest

from services.tokenizer.content_format import joined_parts, split_parts
from services.tokenizer.image_tokens import ImageSize, read_image_tokens

IMAGE, VIDEO = "<|image_pad|>", "<|video_pad|>"
QWEN2_VL = {"model_type": "qwen2_vl", "vision_config": {"patch_size": 14, "spatial_merge_size": 2,
                                                        "temporal_patch_size": 2}}


def test_a_videos_mark_is_made_a_run_of_its_frame_pairs_squares_beside_images():
    tokens = read_image_tokens({}, {}, QWEN2_VL)
    text = f"a {VIDEO} b {IMAGE} c {VIDEO}"
    sizes = [ImageSize(56, 84, frames=4), ImageSize(28, 56), ImageSize(28, 28, frames=6)]
    assert tokens.expanded(text, sizes, 3) == f"a {VIDEO * (2 * 2 * 3)} b {IMAGE * 2} c {VIDEO * 3}"


@pytest.mark.parametrize("text, sizes, message", [
    (f"{IMAGE}", [ImageSize(28, 28, frames=2)], "wrote <|image_pad|> where the prompt's 1. item is a video"),
    (f"{VIDEO}", [ImageSize(28, 28)], "wrote <|video_pad|> where the prompt's 1. item is an image"),
    (f"{VIDEO} {VIDEO}", [ImageSize(28, 28, frames=2)], "wrote 2 image or video mark"),
    (f"{VIDEO}", None, "need their sizes"),
])
def test_marks_that_do_not_fit_the_items_are_refused(text, sizes, message):
    with pytest.raises(ValueError, match=message):
        read_image_tokens({}, {}, QWEN2_VL).expanded(text, sizes, 1)


def test_qwen3_vls_video_is_a_run_a_frame_pair_each_after_its_time():
    """As Qwen3VLProcessor writes it: the template's video between its vision marks made each pair's."""
    tokens = read_image_tokens({}, {}, {**QWEN2_VL, "model_type": "qwen3_vl"})
    start, end = "<|vision_start|>", "<|vision_end|>"
    text = f"a {start}{VIDEO}{end} b {start}{IMAGE}{end}"
    sizes = [ImageSize(28, 56, frames=4, times=(0.25, 1.75)), ImageSize(28, 28)]
    pair = f"{start}{VIDEO * 2}{end}"
    assert tokens.expanded(text, sizes, 2) == f"a <0.2 seconds>{pair}<1.8 seconds>{pair} b {start}{IMAGE}{end}"
    with pytest.raises(ValueError, match="2 frame pair.* needs each one's time, got 1"):
        tokens.expanded(text, [ImageSize(28, 56, frames=4, times=(0.25,)), ImageSize(28, 28)], 2)


def test_a_messages_parts_place_its_videos_among_its_texts_and_images():
    """common.proto's ChatMessage: texts in order, images and videos at their indexes; indexes that repeat or fall
    past the parts refused (the tokenizer service's INVALID_ARGUMENT), not a crash."""
    parts = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}, {"type": "video"}]
    assert split_parts(parts) == (["a", "b"], [1], [3])
    assert joined_parts(["a", "b"], [1], [3]) == parts
    for images, videos in (([1], [1]), ([], [5]), ([2, 2], [])):
        with pytest.raises(ValueError, match="distinct indexes among its parts"):
            joined_parts(["a"], images, videos)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5s_image_mark_is_a_run_of_a_token_a_square(model_type):
    """Qwen3.5's processor (Qwen3-VL's): a token for each 32-pixel square of the resized image."""
    config = {"model_type": model_type, "vision_config": {"patch_size": 16, "spatial_merge_size": 2}}
    assert read_image_tokens({}, {}, config).expanded(f"a {IMAGE} b", [ImageSize(64, 96)], 1) == f"a {IMAGE * 6} b"


def test_norths_marks_are_its_own_and_its_videos_timed_as_qwen3_vls():
    """CohereCompassProcessor's (Qwen3VLProcessor's, under marks of its own)."""
    tokens = read_image_tokens({}, {}, {**QWEN2_VL, "model_type": "cohere_compass"})
    image, video, start, end = "<|IMAGE_PAD|>", "<|VIDEO_PAD|>", "<|VISION_START|>", "<|VISION_END|>"
    text = f"a {start}{video}{end} b {start}{image}{end}"
    sizes = [ImageSize(28, 56, frames=2, times=(0.5,)), ImageSize(28, 56)]
    assert tokens.expanded(text, sizes, 2) == f"a <0.5 seconds>{start}{video * 2}{end} b {start}{image * 2}{end}"

