"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's videos against transformers' Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration and Qwen3VLForConditionalGeneration on the same weights: a video's frames taken two
at a time by the tower (a pair's patches spanning both frames, each pair attending within itself), its rows one run of
video tokens placed by multimodal RoPE with its frame pairs one time position apart (Qwen2-VL's) or tokens_per_second
a second apart (Qwen2.5-VL's, by the video's frames a second); Qwen3-VL's (and Qwen3.5's, without DeepStack, in its
hybrid text model; and Cohere's North's, in its Command A text model) a run a frame pair, each after its time in text
and placed as an image is, DeepStack's rows added at them; beside images in the same prompt; features, greedy
tokens and logprobs, in one chunk or many; decoded from handed-over pages without its pixels."""
from __future__ import annotations

import pytest
import torch

from engine.prompt_images import ImageInput, WithheldImage, mrope_positions, placed_images
from engine.sampling_params import SamplingParams
from engine.vision.vision_config import qwen2_5_vl_vision_config
from tests.parity.conftest import decoded_from_handed_over_pages
from tests.parity.images import (
    Requests,
    assert_logprobs_match,
    assert_transformers_tokens,
    hf_greedy,
    image_engine,
    patchified_video,
    saved_qwen_vl,
)
from tests.parity.test_qwen_vl_images import IMAGE, MEAN, PIXELS_PER_TOKEN, STD, VISION_END, VISION_START, _hf_inputs

VIDEO = 501
MAX_NEW_TOKENS = 8
FPS = 4.0  # Qwen2.5-VL's pairs then 2 / 4 s x 2 tokens a second = one time position apart
# (frames, height, width): whole pairs; the time positions within the larger side's, where transformers 5 and
# Qwen's own code place the text after a video alike (mrope_positions)
VIDEOS = [(4, 32, 48), (6, 24, 16)]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "cohere_compass"])
def qwen_vl(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    times = {"tokens_per_second": 2} if request.param == "qwen2_5_vl" else {}
    return path, saved_qwen_vl(request.param, path, 43, times, image_token_id=IMAGE, video_token_id=VIDEO,
                               vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def _videos(seed: int, shapes: list[tuple[int, int, int]], fps: float = FPS) -> list[ImageInput]:
    g = torch.Generator().manual_seed(seed)
    return [ImageInput(torch.randint(0, 256, (t, h, w, 3), dtype=torch.uint8, generator=g), 1 / 255, MEAN, STD,
                       fps=fps) for t, h, w in shapes]


def _images(seed: int, sizes: list[tuple[int, int]]) -> list[ImageInput]:
    g = torch.Generator().manual_seed(seed)
    return [ImageInput(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g), 1 / 255, MEAN, STD)
            for h, w in sizes]


def _squares(item: ImageInput) -> int:
    height, width = item.shape[:2]
    return height // PIXELS_PER_TOKEN * (width // PIXELS_PER_TOKEN)


def _prompt(seed: int, items: list[ImageInput], timed: bool = False) -> list[int]:
    """Text, and each item's tokens between vision marks; `timed` (Qwen3-VL's), a video's frame pairs each between
    its own marks after its time (two text tokens here: "<0.5 seconds>")."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, 490, (n,), generator=g).tolist()  # noqa: E731
    prompt = text(5)
    for i, item in enumerate(items):
        if not item.frames:
            prompt += [VISION_START, *[IMAGE] * _squares(item), VISION_END]
        elif timed:
            for _ in range(item.frames // 2):
                prompt += [*text(2), VISION_START, *[VIDEO] * _squares(item), VISION_END]
        else:
            prompt += [VISION_START, *[VIDEO] * (item.frames // 2 * _squares(item)), VISION_END]
        prompt += text(3 + i)
    return prompt


def _timed(model) -> bool:
    return type(model).__name__.startswith(("Qwen3", "CohereCompass"))  # (North's processor is Qwen3-VL's)


def _hf_video_inputs(videos: list[ImageInput], with_times: bool) -> dict:
    if not videos:
        return {}
    grids = [[video.frames // 2, video.shape[0] // 4, video.shape[1] // 4] for video in videos]
    inputs = {"pixel_values_videos": torch.cat([patchified_video(video.pixels(), 4) for video in videos]),
              "video_grid_thw": torch.tensor(grids)}
    if with_times:
        inputs["second_per_grid_ts"] = torch.tensor([2 / video.fps for video in videos])
    return inputs


def _hf_logits(model, ids: list[int], items: list[ImageInput]) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    images = [item for item in items if not item.frames]
    videos = [item for item in items if item.frames]
    kinds = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    with_times = "2_5" in type(model).__name__
    with torch.no_grad():
        return model(input_ids=input_ids, mm_token_type_ids=kinds, **_hf_inputs(images),
                     **_hf_video_inputs(videos, with_times)).logits[0, -1]


def _hf_greedy(model, prompt: list[int], items: list[ImageInput]) -> list[int]:
    return hf_greedy(lambda ids: _hf_logits(model, ids, items), prompt, MAX_NEW_TOKENS)


def _requests(seed: int, model) -> Requests:
    mixed = [_videos(seed, VIDEOS[:1])[0], _images(seed, [(16, 24)])[0], _videos(seed + 1, VIDEOS[1:])[0]]
    alone = _videos(seed + 2, [(2, 16, 32)])
    timed = _timed(model)
    return {"mixed": (_prompt(seed, mixed, timed), mixed), "alone": (_prompt(seed + 1, alone, timed), alone)}


def test_video_rows_match_transformers_video_features(qwen_vl):
    path, model = qwen_vl
    encoder = image_engine(path).runner.image_encoder
    videos = _videos(1, VIDEOS)
    with torch.no_grad():
        features = model.model.get_video_features(**_hf_video_inputs(videos, False))
    # Qwen3-VL's DeepStack rows beside the input's, layer by layer.
    deepstack = getattr(features, "deepstack_features", None) or []
    ref = [torch.cat([rows, *(layer[i] for layer in deepstack)], dim=-1)
           for i, rows in enumerate(features.pooler_output)]
    ours = encoder.encode([video.pixels() for video in videos])
    for video, rows, expected in zip(videos, ours, ref, strict=True):
        assert rows.shape == (video.frames // 2 * _squares(video), 64 * (1 + len(deepstack)))
        assert (rows - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("budget", [512, 16, 21])
def test_greedy_tokens_with_videos_and_images_match_transformers(qwen_vl, budget):
    path, model = qwen_vl
    assert_transformers_tokens(image_engine(path, max_num_batched_tokens=budget), _requests(2, model),
                               lambda prompt, items: _hf_greedy(model, prompt, items), MAX_NEW_TOKENS)


def test_logprobs_after_a_video_match_transformers(qwen_vl):
    """The first token's and the third's (two decode steps on, past the video's time positions): a frame pair's
    rows out of order, or a time position off, would leave tokens but not these numbers."""
    path, model = qwen_vl
    prompt, items = _requests(7, model)["mixed"]
    assert_logprobs_match(image_engine(path, max_num_batched_tokens=16), prompt, items,
                          lambda ids: _hf_logits(model, ids, items))


def test_a_video_decoded_without_its_pixels_gives_the_tokens_it_gives_with_them(qwen_vl):
    """A decode worker's copy of the request: each video's frame count and frames a second (its positions) and
    digest, not its pixels."""
    path, model = qwen_vl
    requests = _requests(9, model)
    outputs = decoded_from_handed_over_pages(image_engine(path), image_engine(path), {
        request_id: (prompt, MAX_NEW_TOKENS, {"images": items},
                     {"images": [WithheldImage(item.shape, item.digest, frames=item.frames, fps=item.fps)
                                 for item in items]})
        for request_id, (prompt, items) in requests.items()})
    for request_id, (prompt, items) in requests.items():
        assert outputs[request_id].token_ids == _hf_greedy(model, prompt, items), request_id


def test_the_text_after_a_long_video_counts_on_from_past_its_last_time():
    """As Qwen's own get_rope_index and vLLM place it: one past the video's largest position, here its last frame
    pair's time (3 pairs, 2 s each at 1 frame a second, 4 tokens a second: times 0, 8, 16), not past its larger
    side (2 squares) as transformers 5 counts."""
    vision = qwen2_5_vl_vision_config({"vision_config": {"patch_size": 4, "tokens_per_second": 4},
                                       "video_token_id": VIDEO, "image_token_id": IMAGE})
    video = ImageInput(torch.zeros(6, 16, 8, 3, dtype=torch.uint8), 1 / 255, MEAN, STD, fps=1.0)
    prompt = [7, VISION_START, *[VIDEO] * 6, VISION_END, 8]
    placed, _, rope = placed_images(vision, prompt, [video])
    assert rope.prompt[:, 2:8].tolist() == [[2, 2, 10, 10, 18, 18], [2, 3, 2, 3, 2, 3], [2, 2, 2, 2, 2, 2]]
    assert rope.prompt[:, 8:].tolist() == [[19, 20]] * 3
    assert rope.delta == 20 - 9
    assert mrope_positions(vision, len(prompt), placed).delta == rope.delta


def test_videos_the_model_or_the_prompt_cannot_take_are_refused(qwen_vl):
    path, model = qwen_vl
    engine = image_engine(path)
    params = SamplingParams(max_tokens=4)
    video = _videos(6, [(2, 16, 16)])
    # Two pairs' tokens one run: Qwen3-VL's want a run a pair.
    short = "the prompt holds 1 run" if _timed(model) else "a video takes 8 image tokens, the prompt has 4"
    refusals = {
        "frames come in whole groups of 2": ([1, VISION_START, *[VIDEO] * 4, VISION_END],
                                             _videos(6, [(3, 16, 16)])),
        "a video is placed by tokens 501, the prompt has 500": ([1, VISION_START, *[IMAGE] * 4, VISION_END], video),
        short: ([1, VISION_START, *[VIDEO] * 4, VISION_END], _videos(6, [(4, 16, 16)])),
    }
    if "2_5" in path.name:
        refusals["needs its frames a second"] = (_prompt(6, video), _videos(6, [(2, 16, 16)], fps=0.0))
    for message, (prompt, items) in refusals.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", prompt, params, images=items)
    with pytest.raises(ValueError, match="more than its limit of 0"):
        image_engine(path, limit_videos=0).add_request("r", _prompt(6, video), params, images=video)
    assert not engine.has_unfinished_requests()
