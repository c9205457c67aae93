"""Qwen3.5's images (Qwen3_5ForConditionalGeneration) against transformers on the same weights: Qwen3-VL's tower
without DeepStack, its rows in place of each image's run of tokens in the hybrid text model (its linear-attention
layers' states carry them on; its full-attention layers place them by interleaved multimodal RoPE); features,
greedy tokens and logprobs in one chunk or many, computed again after a preemption, decoded by another engine from
the pages and states handed over."""
from __future__ import annotations

import pytest
import torch

from engine.prompt_images import WithheldImage
from tests.parity.conftest import decoded_from_handed_over_pages
from tests.parity.images import assert_logprobs_match, image_engine, padded, saved_qwen_vl
from tests.parity.test_qwen_vl_images import (
    IMAGE,
    PIXELS_PER_TOKEN,
    SIZES,
    VISION_END,
    VISION_START,
    _assert_transformers_tokens,
    _hf_greedy,
    _hf_inputs,
    _hf_logits,
    _images,
    _prompt,
    _requests,
)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, saved_qwen_vl("qwen3_5", path, 35, image_token_id=IMAGE, vision_start_token_id=VISION_START,
                               vision_end_token_id=VISION_END)


def test_image_rows_match_transformers_image_features(qwen3_5):
    path, model = qwen3_5
    engine = image_engine(path)
    assert engine.model_config.vision.deepstack_layers == ()
    images = _images(1, SIZES)
    with torch.no_grad():
        features = model.model.get_image_features(**_hf_inputs(images)).pooler_output
    ours = engine.runner.image_encoder.encode([image.pixels() for image in images])
    for (height, width), rows, expected in zip(SIZES, ours, features, strict=True):
        assert rows.shape == (height // PIXELS_PER_TOKEN * (width // PIXELS_PER_TOKEN), 64)
        assert (rows - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("budget", [512, 16, 21])
def test_greedy_tokens_with_images_match_transformers(qwen3_5, budget):
    path, model = qwen3_5
    _assert_transformers_tokens(image_engine(path, max_num_batched_tokens=budget), model, _requests(2))


@pytest.mark.parametrize("budget", [512, 16])
def test_first_and_later_token_logprobs_with_images_match_transformers(qwen3_5, budget):
    path, model = qwen3_5
    images = _images(7, SIZES)
    assert_logprobs_match(image_engine(path, max_num_batched_tokens=budget), _prompt(7, images), images,
                          lambda ids: _hf_logits(model, ids, images))


def test_images_computed_again_after_a_preemption_give_the_same_tokens(qwen3_5):
    path, model = qwen3_5
    requests = {}
    for i in range(2):
        images = _images(5 + i, [(32, 32), (16, 24)])
        requests[f"r{i}"] = (padded(_prompt(5 + i, images), 64), images)
    # 4 pages of tokens each and 1 of states: both admitted into 10 of 11 pages, one preempted as they grow.
    engine = image_engine(path, num_kv_blocks=11, max_num_batched_tokens=128)
    assert engine.block_manager.num_state_blocks == 1
    _assert_transformers_tokens(engine, model, requests)
    assert engine.scheduler.num_preemptions > 0


def test_a_decode_engine_without_the_pixels_goes_on_from_the_pages_and_states_handed_over(qwen3_5):
    path, model = qwen3_5
    requests = _requests(4)
    outputs = decoded_from_handed_over_pages(image_engine(path), image_engine(path), {
        request_id: (prompt, 8, {"images": images},
                     {"images": [WithheldImage(image.shape, image.digest) for image in images]})
        for request_id, (prompt, images) in requests.items()})
    for request_id, (prompt, images) in requests.items():
        assert outputs[request_id].token_ids == _hf_greedy(model, prompt, images), request_id
