"""Gemma 3's images against transformers' Gemma3ForConditionalGeneration on the same weights: the SigLIP
tower and projector's rows in place of each image's tokens, which attend to each other bidirectionally
(token_type_ids' blocks), logits and greedy tokens, in one chunk or many, and recomputed after a preemption."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prompt_images import ImageInput, ImageRows
from engine.sampling_params import SamplingParams
from tests.parity.conftest import greedy_outputs, transformers

IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE = 500, 498, 499
TOKENS_PER_IMAGE = 16  # 8x8 patches pooled 2x2
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma3_with_images(tmp_path_factory):
    text = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, head_dim=16,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                         sliding_window=24, query_pre_attn_scalar=24, initializer_range=0.2,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=112, patch_size=14)
    torch.manual_seed(11)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE_TOKEN, boi_token_index=BEGIN_IMAGE, eoi_token_index=END_IMAGE)).eval()
    with torch.no_grad():  # norms, biases and the projection off their init, so each one counts
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "projection" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("gemma3-images")
    model.save_pretrained(path)
    return path, model


def _image(n: int) -> list[int]:
    return [BEGIN_IMAGE, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, END_IMAGE]


def _prompt(seed: int, num_images: int = 2) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, 490, (n,), generator=g).tolist()  # noqa: E731
    prompt = [2, *text(5)]
    for i in range(num_images):
        prompt += _image(i) + text(7 + i)
    return prompt


def _images(seed: int, n: int) -> list[ImageInput]:
    """Random images as an image processor resized them, normalized as Gemma 3's is."""
    rgb = torch.randint(0, 256, (n, 112, 112, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return [ImageInput(image, 1 / 255, (0.5, 0.4, 0.3), (0.5, 0.25, 0.2)) for image in rgb]


def _pixels(images: list[ImageInput]) -> torch.Tensor | None:
    """What transformers' model reads of them."""
    return torch.stack([image.pixels() for image in images]) if images else None


def _hf_greedy(model, prompt: list[int], pixels: torch.Tensor) -> list[int]:
    """Greedy tokens by whole forward passes (no cache): image tokens typed 1, as the processor types them."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            ids = torch.tensor([prompt + tokens])
            logits = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE_TOKEN).long()).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def _engine(path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(path), "dtype": "float32", "num_kv_blocks": 64,
                                     "max_num_batched_tokens": 512, **options}))


def _generate(engine: LLMEngine, requests: dict[str, tuple[list[int], list[torch.Tensor]]]) -> dict[str, list[int]]:
    return greedy_outputs(engine, {request_id: (prompt, {"images": images})
                                   for request_id, (prompt, images) in requests.items()}, MAX_NEW_TOKENS)


def test_image_rows_match_transformers_image_features(gemma3_with_images):
    path, model = gemma3_with_images
    engine = _engine(path)
    pixels = _pixels(_images(1, 2))
    with torch.no_grad():
        ref = model.model.get_image_features(pixels).pooler_output
    assert (engine.runner.image_encoder(pixels) - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("budget", [512, 16, 20])
def test_greedy_tokens_with_images_match_transformers(gemma3_with_images, budget):
    """Budgets of 16 and 20 split the prompts into chunks: an image's 16 tokens are never split, as they attend
    to each other."""
    path, model = gemma3_with_images
    prompts = {"two": (_prompt(2), _images(2, 2)), "one": (_prompt(3, 1), _images(3, 1)), "text": (_prompt(4, 0), [])}
    results = _generate(_engine(path, max_num_batched_tokens=budget), prompts)
    for request_id, (prompt, images) in prompts.items():
        assert results[request_id] == _hf_greedy(model, prompt, _pixels(images)), request_id


def test_images_given_as_their_rows_give_the_tokens_their_pixels_give(gemma3_with_images):
    """vLLM's image_embeds: each image given as transformers' tower, pooling and projector's rows for it
    (attended both ways, as an encoded image's)."""
    path, model = gemma3_with_images
    prompt, images = _prompt(12), _images(12, 2)
    with torch.no_grad():
        rows = model.model.get_image_features(_pixels(images)).pooler_output
    given = [ImageRows(image_rows, (112, 112, 3)) for image_rows in rows]
    engine = _engine(path, max_num_batched_tokens=16)
    assert _generate(engine, {"rows": (prompt, given)})["rows"] == _hf_greedy(model, prompt, _pixels(images))


def test_an_engine_without_its_image_encoder_takes_images_as_their_rows_alone(gemma3_with_images):
    """vLLM's encoder-less serving (--limit-mm-per-prompt '{"image": 0}' with --enable-mm-embeds): the image
    encoder never loaded, images given as their rows get transformers' tokens for their pixels; pixels are refused."""
    path, model = gemma3_with_images
    prompt, images = _prompt(13), _images(13, 2)
    with torch.no_grad():
        rows = model.model.get_image_features(_pixels(images)).pooler_output
    engine = _engine(path, limit_images=0, enable_mm_embeds=True)
    assert engine.runner.image_encoder is None
    given = [ImageRows(image_rows, (112, 112, 3)) for image_rows in rows]
    assert _generate(engine, {"rows": (prompt, given)})["rows"] == _hf_greedy(model, prompt, _pixels(images))
    with pytest.raises(ValueError, match="images come only as their encoder's rows"):
        engine.add_request("pixels", prompt, SamplingParams(max_tokens=2), images=images)


@pytest.mark.parametrize("budget", [512, 16])
def test_first_token_logprobs_with_images_match_transformers(gemma3_with_images, budget):
    """Logprobs, not only tokens: an image's tokens attended causally would still give these greedy tokens
    here, but not these numbers."""
    path, model = gemma3_with_images
    prompt, images = _prompt(7), _images(7, 2)
    pixels = _pixels(images)
    engine = _engine(path, max_num_batched_tokens=budget)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), images=images)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    ours = outputs[-1].new_logprobs[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE_TOKEN).long()).logits[0, -1]
    ref = torch.log_softmax(logits, dim=-1)
    assert max(abs(logprob - float(ref[token])) for token, logprob in ours.items()) < 1e-4


def test_an_image_computed_again_after_a_preemption_gives_the_same_tokens(gemma3_with_images):
    path, model = gemma3_with_images
    # 62-token prompts: both admitted into 8 of the 9 pages, both past their 4th page within 3 tokens.
    prompts = {f"r{i}": (_prompt(5 + i) + [7, 8, 9, 10, 11], _images(5 + i, 2)) for i in range(2)}
    engine = _engine(path, num_kv_blocks=9, max_num_batched_tokens=128)
    results = _generate(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    for request_id, (prompt, images) in prompts.items():
        assert results[request_id] == _hf_greedy(model, prompt, _pixels(images)), request_id


def test_images_the_prompt_does_not_place_are_refused(gemma3_with_images, tiny_model_dirs):
    path, _ = gemma3_with_images
    engine = _engine(path)
    params = SamplingParams(max_tokens=4)
    refusals = {
        "1 run\\(s\\) of image tokens .* for 2 image": (_prompt(6, 1), _images(6, 2)),
        "takes 16 image tokens, the prompt has 15": ([2, *[IMAGE_TOKEN] * 15, 7], _images(6, 1)),
        "must be 112x112 pixels": (_prompt(6, 1), [ImageInput(torch.zeros(56, 56, 3, dtype=torch.uint8), 1 / 255,
                                                                   (0.5,) * 3, (0.5,) * 3)]),
        "a number for each of its 3 channels": (_prompt(6, 1), [ImageInput(_images(6, 1)[0].rgb, 1 / 255, (0.5,),
                                                                           (0.5,))]),
    }
    for message, (prompt, images) in refusals.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", prompt, params, images=images)
    with pytest.raises(ValueError, match="takes no images"):
        _engine(tiny_model_dirs["gemma3"]).add_request("r", _prompt(6, 1), params, images=_images(6, 1))
    assert not engine.has_unfinished_requests()


def test_limits_on_a_prompts_images(gemma3_with_images):
    """vLLM's --limit-mm-per-prompt: more images than the limit are refused, an image's pan-and-scan crops
    counted with it; 0 serves the text model alone, its image encoder never loaded, with the same tokens for a
    prompt without images."""
    path, model = gemma3_with_images
    params = SamplingParams(max_tokens=4)
    limited = _engine(path, limit_images=1)
    with pytest.raises(ValueError, match="more than its limit of 1"):
        limited.add_request("r", _prompt(8), params, images=_images(8, 2))
    image, *crops = _images(8, 3)
    limited.add_request("cropped", _prompt(8, 3), params, images=[image, *(replace(c, crop=True) for c in crops)])
    text_only = _engine(path, limit_images=0)
    assert text_only.runner.image_encoder is None
    with pytest.raises(ValueError, match="limited to 0"):
        text_only.add_request("r", _prompt(8, 1), params, images=_images(8, 1))
    prompt = _prompt(9, 0)
    assert _generate(text_only, {"text": (prompt, [])})["text"] == _hf_greedy(model, prompt, None)
