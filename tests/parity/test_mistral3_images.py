"""Mistral 3's images against transformers' Mistral3ForConditionalGeneration on the same weights: the Pixtral
tower (2D RoPE over an image of any size) and the projector (RMSNorm, 2x2 patch merger, MLP), whose rows take
the places of each image's [IMG] tokens, a run a row of its grid between [IMG_BREAK]s; features, logits and
greedy tokens, in one chunk or many, recomputed after a preemption, for Mistral and Ministral 3 text models,
in the released layout and transformers 4's."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.prompt_images import ImageInput
from engine.sampling_params import SamplingParams
from tests.parity.conftest import transformers
from tests.parity.images import Requests, assert_transformers_tokens, hf_greedy, image_engine, padded

IMAGE, BREAK, END = 10, 12, 13  # Mistral's [IMG], [IMG_BREAK], [IMG_END]
PIXELS_PER_TOKEN = 8  # patches of 4 pixels, merged 2x2
MAX_NEW_TOKENS = 8
MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)


def _save(text, tmp_path_factory, name: str, seed: int):
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, image_size=64, patch_size=4, hidden_act="silu")
    torch.manual_seed(seed)
    model = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=IMAGE,
        multimodal_projector_bias=True)).eval()
    with torch.no_grad():  # norms and biases off their init, so each one counts
        for param_name, p in model.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    text = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      sliding_window=None, initializer_range=0.2)
    return _save(text, tmp_path_factory, "mistral3", 21)


@pytest.fixture(scope="module")
def ministral3(tmp_path_factory):
    text = transformers.Ministral3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                         initializer_range=0.2, max_position_embeddings=4096)
    return _save(text, tmp_path_factory, "ministral3", 22)


def _image_tokens(height: int, width: int) -> list[int]:
    """As transformers' PixtralProcessor expands an image's [IMG] mark (a row of [IMG]s and a break for each row
    of its grid, the last break an end). The processor itself needs torchvision, which has no build for this
    torch here: the expansion is written out."""
    rows, cols = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    tokens = ([IMAGE] * cols + [BREAK]) * rows
    return tokens[:-1] + [END]


SIZES = [(32, 48), (64, 16), (24, 24)]


def _images(seed: int, sizes: list[tuple[int, int]]) -> list[ImageInput]:
    g = torch.Generator().manual_seed(seed)
    return [ImageInput(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g), 1 / 255, MEAN, STD)
            for h, w in sizes]


def _prompt(seed: int, images: list[ImageInput]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(20, 500, (n,), generator=g).tolist()  # noqa: E731
    prompt = [1, 3, *text(5)]
    for i, image in enumerate(images):
        prompt += _image_tokens(*image.rgb.shape[:2]) + text(4 + i)
    return prompt + [4]


def _hf_inputs(images: list[ImageInput]) -> dict:
    """What transformers' model reads of them: pixels padded to the largest (as the processor pads a batch), and
    each one's size."""
    if not images:
        return {}
    pixels = [image.pixels() for image in images]
    height, width = max(p.shape[1] for p in pixels), max(p.shape[2] for p in pixels)
    stacked = torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[2], 0, height - p.shape[1])) for p in pixels])
    return {"pixel_values": stacked, "image_sizes": torch.tensor([list(p.shape[1:]) for p in pixels])}


def _hf_logits(model, ids: list[int], images: list[ImageInput]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **_hf_inputs(images)).logits[0, -1]


def _hf_greedy(model, prompt: list[int], images: list[ImageInput]) -> list[int]:
    return hf_greedy(lambda ids: _hf_logits(model, ids, images), prompt, MAX_NEW_TOKENS)


def _requests(seed: int) -> Requests:
    three, one = _images(seed, SIZES), _images(seed + 1, [(40, 56)])
    return {"three": (_prompt(seed, three), three), "one": (_prompt(seed + 1, one), one),
            "text": (_prompt(seed, []), [])}


def _assert_transformers_tokens(engine, model, requests: Requests) -> None:
    assert_transformers_tokens(engine, requests, lambda prompt, images: _hf_greedy(model, prompt, images),
                               MAX_NEW_TOKENS)


def test_image_rows_match_transformers_image_features(mistral3):
    path, model = mistral3
    encoder = image_engine(path).runner.image_encoder
    images = _images(1, SIZES)
    inputs = _hf_inputs(images)
    with torch.no_grad():
        ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
    ours = encoder.encode([image.pixels() for image in images])
    for (height, width), rows, expected in zip(SIZES, ours, ref, strict=True):
        assert rows.shape == (height // PIXELS_PER_TOKEN * (width // PIXELS_PER_TOKEN), 64)
        assert (rows - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("budget", [512, 16, 21])
def test_greedy_tokens_with_images_match_transformers(mistral3, budget):
    """Budgets of 16 and 21 end chunks inside images' rows: Mistral 3's image tokens attend causally."""
    path, model = mistral3
    requests = _requests(2)
    _assert_transformers_tokens(image_engine(path, max_num_batched_tokens=budget), model, requests)


def test_a_ministral3_text_model_with_images_matches_transformers(ministral3):
    path, model = ministral3
    requests = _requests(3)
    _assert_transformers_tokens(image_engine(path), model, requests)


@pytest.mark.parametrize("budget", [512, 16])
def test_first_token_logprobs_with_images_match_transformers(mistral3, budget):
    """Logprobs, not only tokens: rows placed a token off, or an image's rows transposed, would still give some
    greedy tokens here, but not these numbers."""
    path, model = mistral3
    images = _images(7, SIZES)
    prompt = _prompt(7, images)
    engine = image_engine(path, max_num_batched_tokens=budget)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), images=images)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    ref = torch.log_softmax(_hf_logits(model, prompt, images), dim=-1)
    ours = outputs[-1].new_logprobs[0]
    assert max(abs(logprob - float(ref[token])) for token, logprob in ours.items()) < 1e-4


def test_images_computed_again_after_a_preemption_give_the_same_tokens(mistral3):
    path, model = mistral3
    # 64-token prompts: both admitted into 8 of the 9 pages, both past their 4th page within 3 tokens.
    requests = {}
    for i in range(2):
        images = _images(5 + i, [(32, 48), (16, 32)])
        prompt = _prompt(5 + i, images)
        requests[f"r{i}"] = (padded(prompt, 64), images)
    engine = image_engine(path, num_kv_blocks=9, max_num_batched_tokens=128)
    _assert_transformers_tokens(engine, model, requests)
    assert engine.scheduler.num_preemptions > 0


def test_transformers_4_layout_gives_the_same_tokens(mistral3, tmp_path):
    """transformers 4.5x saved Mistral 3 under `model.` (model.vision_tower, model.multi_modal_projector,
    model.language_model) with its own lm_head."""
    path, model = mistral3
    tensors = load_file(path / "model.safetensors")
    renamed = {"model." + name.replace("language_model.model.", "language_model."): t for name, t in tensors.items()}
    renamed["lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"].clone()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(path / name, tmp_path / name)
    save_file(renamed, tmp_path / "model.safetensors")
    requests = _requests(4)
    _assert_transformers_tokens(image_engine(tmp_path), model, requests)


def test_images_the_prompt_does_not_place_are_refused(mistral3):
    path, _ = mistral3
    engine = image_engine(path)
    params = SamplingParams(max_tokens=4)
    image = _images(6, [(32, 48)])
    refusals = {
        "3 run\\(s\\) of image tokens .* for 1 image\\(s\\), which take 4": ([1, *_image_tokens(24, 48), 5], image),
        "an image row takes 6 image tokens, the prompt has 5 at position 8": (
            [1, *_image_tokens(32, 48)[:7], *_image_tokens(32, 40)[6:], 5], image),
        "must have sides of at most 64 pixels .* each a multiple of 8": (
            [1, *_image_tokens(32, 48), 5], _images(6, [(32, 44)])),
        "at most 64 pixels": ([1, *_image_tokens(72, 8), 5], _images(6, [(72, 8)])),
        "\\[height, width, 3\\]": ([1, *_image_tokens(32, 48), 5],
                                  [ImageInput(torch.zeros(32, 48, dtype=torch.uint8), 1 / 255, MEAN, STD)]),
    }
    for message, (prompt, images) in refusals.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", prompt, params, images=images)
    assert not engine.has_unfinished_requests()


def test_an_image_is_encoded_with_the_chunk_that_reaches_it_and_not_again_from_the_prefix_cache(mistral3):
    """A prompt chunked by 16 encodes each of its images with the chunk that first holds its tokens; a second
    request whose prefix the cache holds, the image wholly in it, encodes none and still gives transformers'
    tokens (its image is in the cached pages' KV)."""
    path, model = mistral3
    engine = image_engine(path, max_num_batched_tokens=16)
    encoded: list[int] = []
    encode = engine.runner.image_encoder.encode
    engine.runner.image_encoder.encode = lambda pixels: encoded.append(len(pixels)) or encode(pixels)
    two = _images(11, [(16, 48), (16, 32)])
    prompt = _prompt(11, two)  # images at [7, 21) and [25, 35): chunks [0, 16) and [16, 32) reach one each
    _assert_transformers_tokens(engine, model, {"two": (prompt, two)})
    assert encoded == [1, 1]
    encoded.clear()
    image = two[:1]
    prefix = [1, 3, 50, 51, 52, *_image_tokens(16, 48), *range(60, 73)]  # 32 tokens: two whole pages
    first, second = prefix + [80, 81, 82], prefix + [90, 91, 92, 93]
    _assert_transformers_tokens(engine, model, {"first": (first, image)})
    assert encoded == [1]
    _assert_transformers_tokens(engine, model, {"second": (second, image)})
    assert encoded == [1]


def test_a_cached_image_is_encoded_when_its_tokens_are_computed_after_all(mistral3):
    """An image a step never reached stays pending (a prefix cache hit over it, a decode worker's request): a
    later chunk that holds its tokens (after a preemption, the cache evicted) encodes it then."""
    from engine.prompt_images import encode_pending_images, placed_images
    from engine.sequence import Sequence

    path, _ = mistral3
    engine = image_engine(path)
    images = _images(12, [(16, 48)])
    prompt = _prompt(12, images)
    pending, spans, rope = placed_images(engine.model_config.vision, prompt, images)
    seq = Sequence("r", prompt, SamplingParams(max_tokens=1), 16, images=pending, bidirectional_spans=spans)
    encode_pending_images(engine.runner.image_encoder, seq, 32, len(prompt) - 32, "cpu")
    assert seq.pending_images == pending and seq.given_embeddings == ()
    encode_pending_images(engine.runner.image_encoder, seq, 0, 16, "cpu")
    assert seq.pending_images == () and [start for start, _ in seq.given_embeddings] == [7, 14]
    assert spans == () and rope is None  # Mistral 3's image tokens attend causally, at their token positions
