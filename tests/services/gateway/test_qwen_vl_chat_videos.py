"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's videos through the mesh, by the `openai` client and the gRPC API: a chat's
video_url part (a lossless video made here, as a data: URL) decoded by the gateway, its frames sampled as vLLM
samples them (Qwen's 2 a second; or --media-io-kwargs' num_frames spread evenly), kept at their size (whole 8-pixel
squares within the processor's bounds, so the test's frames are the model's), padded to whole pairs; the tokenizer
service writes the template's <|video_pad|> mark as a run of the frame pairs' squares (Qwen3-VL's a run a pair, each
after its time); the workers encode the frames two at a time and place them by multimodal RoPE (Qwen2.5-VL's frame
pairs at their times). Greedy tokens and their top logprobs equal transformers' on the same frames, with an image
beside the video.

transformers' Qwen2VLVideoProcessor needs torchvision, which has no build for this torch here: the test lays the
frames out as it does (tests/parity/images.py's patchified_video)."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch

from engine.prompt_images import ImageInput
from protos import gateway_pb2
from tests.parity.conftest import transformers
from tests.parity.images import patchified_video, saved_qwen_vl
from tests.services.gateway.image_chats import (
    assert_same_reply,
    data_url,
    encoded_video,
    greedy_chat,
    greedy_chat_by_a_local_gateway,
    greedy_grpc_chat,
    greedy_logprobs,
    qwen_vl_tokenizer,
    random_image,
    rendering_mesh,
)
from tests.services.gateway.mesh import metric_value

pytest.importorskip("av")

IMAGE, VIDEO, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
MARKS = {VISION_START: 498, VISION_END: 499, IMAGE: 500, VIDEO: 501}
MIN_PIXELS, MAX_PIXELS = 16 * 16, 40 * 8 * 8
VIDEO_MAX_PIXELS = 64 * 8 * 8 * 8  # Qwen2-VL's a frame's, Qwen3-VL's the whole video's: the test videos' as they are
MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)
# Qwen2-VL's template, shortened: a message's parts in turn, an image or video part as its vision marks.
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }} {% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
            "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
            "{% elif content['type'] == 'text' %}{{ content['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> "
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
FPS = 5  # the test videos': 10 frames, 2 s, sampled at 2 a second to 4 (frames 0, 2, 5 and 7; Qwen3-VL's 0, 3, 6, 9)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def qwen_vlm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    times = {"tokens_per_second": 2} if request.param == "qwen2_5_vl" else {}
    model = saved_qwen_vl(request.param, path, 53, times, image_token_id=MARKS[IMAGE], video_token_id=MARKS[VIDEO],
                          vision_start_token_id=MARKS[VISION_START], vision_end_token_id=MARKS[VISION_END])
    tokenizer = qwen_vl_tokenizer(MARKS, TEMPLATE)
    tokenizer.save_pretrained(path)
    image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                                            image_mean=list(MEAN), image_std=list(STD))
    image_processor.save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps({
        "min_pixels": MIN_PIXELS, "max_pixels": VIDEO_MAX_PIXELS, "patch_size": 4, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": list(MEAN), "image_std": list(STD)}))
    return path, model, tokenizer, image_processor


@pytest.fixture(scope="module")
def vlm_mesh(qwen_vlm):
    with rendering_mesh(qwen_vlm[0]) as mesh:
        yield mesh


def _frames(seed: int, num_frames: int = 10, size: tuple[int, int] = (24, 32)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_frames, *size, 3), dtype=np.uint8)


def _video_url(frames: np.ndarray) -> str:
    return "data:video/x-matroska;base64," + base64.b64encode(encoded_video(frames, fps=FPS)).decode()


def _timed(qwen_vlm) -> bool:
    return "Qwen3" in type(qwen_vlm[1]).__name__


def _video_part(qwen_vlm, frames: np.ndarray, indices: list[int] | None = None) -> dict:
    """The part of `_transformers_greedy` for a video of `frames` at FPS sampled to `indices` (by default as the
    model's processor samples 10 frames at 2 a second)."""
    if indices is None:
        indices = [0, 3, 6, 9] if _timed(qwen_vlm) else [0, 2, 5, 7]
    times = transformers.Qwen3VLProcessor._calculate_timestamps(None, list(indices), FPS, 2)
    return {"type": "video", "video": frames[indices], "fps": len(indices) / len(frames) * FPS, "times": times}


def _transformers_greedy(qwen_vlm, content: list[dict]) -> tuple[list[int], list[torch.Tensor], int]:
    """Transformers' greedy tokens and logprobs for a user message of `content`: text, {"type": "image", "image":
    PIL image} and `_video_part` parts."""
    _, model, tokenizer, image_processor = qwen_vlm
    images = [part["image"] for part in content if part["type"] == "image"]
    videos = [part for part in content if part["type"] == "video"]
    inputs = dict(image_processor(images=images, return_tensors="pt")) if images else {}
    grids = {IMAGE: iter(inputs["image_grid_thw"].tolist() if images else [])}
    if videos:
        frames = [np.concatenate([v["video"], v["video"][-1:]]) if len(v["video"]) % 2 else v["video"] for v in videos]
        pixels = [ImageInput(torch.from_numpy(f), 1 / 255, MEAN, STD).pixels() for f in frames]
        inputs["pixel_values_videos"] = torch.cat([patchified_video(p, 4) for p in pixels])
        inputs["video_grid_thw"] = torch.tensor([[len(f) // 2, f.shape[1] // 4, f.shape[2] // 4] for f in frames])
        if "2_5" in type(model).__name__:
            inputs["second_per_grid_ts"] = torch.tensor([2 / v["fps"] for v in videos])
        grids[VIDEO] = iter(inputs["video_grid_thw"].tolist())
    text = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": part["type"]} if part["type"] != "text" else part for part in content]}], tokenize=False,
        add_generation_prompt=True)
    if _timed(qwen_vlm):  # as Qwen3VLProcessor writes a video: a run a frame pair, each after its time
        pieces, times = text.split(VISION_START + VIDEO + VISION_END), iter(v["times"] for v in videos)
        text = pieces[0] + "".join("".join(f"<{time:.1f} seconds>{VISION_START}{VIDEO * (h * w // 4)}{VISION_END}"
                                           for time in next(times)) + after
                                   for after in pieces[1:] for _, h, w in [next(grids[VIDEO])])
    for mark in (IMAGE,) if _timed(qwen_vlm) else (IMAGE, VIDEO):  # as Qwen2_5_VLProcessor expands them: a token
        # a square of each frame pair
        pieces = text.split(mark)
        text = pieces[0] + "".join(mark * (t * h * w // 4) + after for after in pieces[1:]
                                   for t, h, w in [next(grids[mark])])
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    tokens, logprobs = greedy_logprobs(lambda current: model(
        input_ids=current, mm_token_type_ids=(current == MARKS[IMAGE]).int() + 2 * (current == MARKS[VIDEO]).int(),
        **inputs).logits[0, -1], ids)
    return tokens, logprobs, ids.shape[1]


def test_a_video_beside_an_image_gets_transformers_reply(vlm_mesh, qwen_vlm):
    """10 frames at 5 a second: 4 kept (2 a second), 2 pairs of 3x4 squares."""
    frames, image = _frames(1), random_image(2, (24, 16))
    content = [{"type": "text", "text": "w1"}, {"type": "video_url", "video_url": {"url": _video_url(frames)}},
               {"type": "text", "text": "w2 w3"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    read_before = metric_value(vlm_mesh.gateway.base_url, "baton_gateway_media_read_seconds_count")
    frames_before = metric_value(vlm_mesh.gateway.base_url, "baton_gateway_video_frames_total")
    with openai.OpenAI(base_url=f"{vlm_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        reply = greedy_chat(client, vlm_mesh.model_name, content)
    expected, logprobs, num_prompt = _transformers_greedy(qwen_vlm, [
        {"type": "text", "text": "w1"}, _video_part(qwen_vlm, frames),
        {"type": "text", "text": "w2 w3"}, {"type": "image", "image": image}])
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt
    counted = httpx.post(f"{vlm_mesh.gateway.base_url}/tokenize", timeout=30, json={
        "model": vlm_mesh.model_name, "messages": [{"role": "user", "content": content}]})
    assert counted.status_code == 200 and counted.json()["count"] == num_prompt
    # Both reads of its media (the chat's, /tokenize's) timed; its 4 frames counted each time.
    assert metric_value(vlm_mesh.gateway.base_url, "baton_gateway_media_read_seconds_count") == read_before + 2
    assert metric_value(vlm_mesh.gateway.base_url, "baton_gateway_video_frames_total") == frames_before + 8
    vlm_mesh.assert_decode_pools_free()


def test_media_io_kwargs_num_frames_spread_a_videos_frames_evenly(vlm_mesh, qwen_vlm):
    """vLLM's --media-io-kwargs '{"video": {"num_frames": 3}}', or a request's media_io_kwargs: frames 0, 4 and 9 (the
    last repeated to a pair), at 1.5 a second."""
    frames = _frames(3)
    content = [{"type": "video_url", "video_url": {"url": _video_url(frames)}}, {"type": "text", "text": "w4"}]
    three = {"video": {"num_frames": 3}}
    by_the_gateway = greedy_chat_by_a_local_gateway(vlm_mesh, content, "--media-io-kwargs", json.dumps(three))
    with openai.OpenAI(base_url=f"{vlm_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        by_the_request = greedy_chat(client, vlm_mesh.model_name, content, media_io_kwargs=three)
        with pytest.raises(openai.BadRequestError, match="positive integer or -1") as refused:
            greedy_chat(client, vlm_mesh.model_name, content, media_io_kwargs={"video": {"num_frames": 0}})
        assert refused.value.body["param"] == "media_io_kwargs"
    expected, logprobs, num_prompt = _transformers_greedy(qwen_vlm, [
        _video_part(qwen_vlm, frames, [0, 4, 9]), {"type": "text", "text": "w4"}])
    for reply in (by_the_gateway, by_the_request):
        assert_same_reply(reply, expected, logprobs)
        assert reply.usage.prompt_tokens == num_prompt


def test_a_requests_mm_processor_kwargs_sample_its_video(vlm_mesh, qwen_vlm):
    """As Qwen's model cards ask of vLLM: `fps` samples the video at that rate (8 of its 10 frames at 4 a second),
    `do_sample_frames` false keeps every frame (5 pairs: 5 squares wide, so transformers 5 places the text after
    them where Qwen's code does)."""
    frames = _frames(9, 10, (24, 40))
    content = [{"type": "video_url", "video_url": {"url": _video_url(frames)}}, {"type": "text", "text": "w6"}]
    faster = [0, 1, 3, 4, 5, 6, 8, 9] if _timed(qwen_vlm) else [0, 1, 2, 3, 5, 6, 7, 8]
    with openai.OpenAI(base_url=f"{vlm_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        for kwargs, indices in [({"fps": 4}, faster), ({"do_sample_frames": False}, list(range(10)))]:
            reply = greedy_chat(client, vlm_mesh.model_name, content, mm_processor_kwargs=kwargs)
            expected, logprobs, num_prompt = _transformers_greedy(qwen_vlm, [
                _video_part(qwen_vlm, frames, indices), {"type": "text", "text": "w6"}])
            assert reply.usage.prompt_tokens == num_prompt, kwargs
            assert_same_reply(reply, expected, logprobs)


def test_the_grpc_api_takes_a_messages_video_urls(vlm_mesh, qwen_vlm):
    frames = _frames(4)
    url = _video_url(frames)

    def generate(options: gateway_pb2.ChatOptions | None = None, **message) -> gateway_pb2.GenerateResponse:
        return greedy_grpc_chat(vlm_mesh.gateway.grpc_address, options, **message)

    reply = generate(content_parts=["w5"], video_parts=[1], video_urls=[url])
    expected, _, num_prompt = _transformers_greedy(qwen_vlm, [
        {"type": "text", "text": "w5"}, _video_part(qwen_vlm, frames)])
    assert list(reply.complete.token_ids) == expected and reply.complete.usage.prompt_tokens == num_prompt
    # The HTTP API's media_io_kwargs: three frames spread evenly.
    reply = generate(gateway_pb2.ChatOptions(media_io_kwargs_json='{"video": {"num_frames": 3}}'),
                     content_parts=["w5"], video_parts=[1], video_urls=[url])
    expected, _, num_prompt = _transformers_greedy(qwen_vlm, [
        {"type": "text", "text": "w5"}, _video_part(qwen_vlm, frames, [0, 4, 9])])
    assert list(reply.complete.token_ids) == expected and reply.complete.usage.prompt_tokens == num_prompt
    refused = generate(gateway_pb2.ChatOptions(media_io_kwargs_json="[3]"), content_parts=["w5"], video_parts=[1],
                       video_urls=[url])
    assert refused.error.code == 400 and refused.error.param == "chat_options.media_io_kwargs_json", refused
    for message, param in [({"content_parts": ["w5"], "video_parts": [1]}, "chat.messages[0].video_urls"),
                           ({"content_parts": ["w5"], "video_parts": [3], "video_urls": [url]},
                            "chat.messages[0].video_parts"),
                           ({"video_parts": [0], "image_parts": [0], "video_urls": [url],
                             "image_urls": [data_url(random_image(5, (16, 16)))]}, "chat.messages[0].video_parts")]:
        refused = generate(**message)
        assert refused.error.code == 400 and refused.error.param == param, refused


def test_videos_that_cannot_be_served_are_refused(vlm_mesh):
    """No page is reserved for any."""
    frames = _frames(6)
    video = {"type": "video_url", "video_url": {"url": _video_url(frames)}}
    with openai.OpenAI(base_url=f"{vlm_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        for url, status, message in [("data:video/mp4;base64," + base64.b64encode(b"not a video").decode(), 400,
                                      "could not be decoded"),
                                     (_video_url(_frames(7, 1)), 400, "too short")]:
            with pytest.raises(openai.APIStatusError, match=message) as refused:
                greedy_chat(client, vlm_mesh.model_name, [{"type": "video_url", "video_url": {"url": url}}])
            assert refused.value.status_code == status
    # Every frame of 10 of 40x64: 75 KiB, past the 50 KiB a worker's message leaves them.
    with pytest.raises(openai.APIStatusError, match="10 frames take 0.1 MiB.*--max-message-bytes") as refused:
        greedy_chat_by_a_local_gateway(vlm_mesh, [{"type": "video_url", "video_url": {"url": _video_url(
            _frames(8, 10, (40, 64)))}}], "--max-message-bytes", str(2**20 + 50 * 2**10), "--media-io-kwargs",
                                       json.dumps({"video": {"num_frames": -1}}))
    assert refused.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="2 videos in one prompt, more than this server's limit of 1"):
        greedy_chat_by_a_local_gateway(vlm_mesh, [video, video], "--limit-mm-per-prompt", '{"video": 1}')
    with pytest.raises(openai.BadRequestError, match="takes no videos here"):
        greedy_chat_by_a_local_gateway(vlm_mesh, [video], "--limit-mm-per-prompt", '{"video": 0}')
    vlm_mesh.assert_decode_pools_free()
