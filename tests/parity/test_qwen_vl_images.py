"""Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and Cohere's North against transformers' Qwen2_5_VLForConditionalGeneration,
Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration and CohereCompassForConditionalGeneration on the
same weights (North's text model Command A's, its full layers without RoPE): their text models with
multimodal RoPE (a text token's three positions one; Qwen3-VL's sections interleaved; Qwen3-VL-MoE's experts
fused, as released or as transformers 5 saves them), and their images: the tower and patch merger's rows in place
of each image's run of tokens (Qwen2.5-VL's windowed tower; Qwen3-VL's with learnt positions resampled to the
image, and DeepStack's rows added to the text model's first layers), placed by their time, height and width
positions (the tokens after an image counting on from the position past its larger side); features, logits and
greedy tokens, in one chunk or many, recomputed after a preemption; the pixels as transformers' Qwen2-VL image
processor gives them."""
from __future__ import annotations

import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from engine.prompt_images import ImageInput, ImageRows, WithheldImage
from engine.sampling_params import SamplingParams
from tests.parity.conftest import decoded_from_handed_over_pages, greedy_outputs, transformers
from tests.parity.images import (
    QWEN_VL,
    Requests,
    assert_logprobs_match,
    assert_transformers_tokens,
    hf_greedy,
    image_engine,
    padded,
    saved_qwen_vl,
)

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

IMAGE, VISION_START, VISION_END = 500, 498, 499
PIXELS_PER_TOKEN = 8  # patches of 4 pixels, merged 2x2
MAX_NEW_TOKENS = 8
MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)
SIZES = [(32, 48), (16, 40), (40, 24)]  # (height, width): windows of 2x2 squares, some cut by the edge


@pytest.fixture(scope="module", params=list(QWEN_VL))
def qwen_vl(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, saved_qwen_vl(request.param, path, 41, image_token_id=IMAGE, vision_start_token_id=VISION_START,
                               vision_end_token_id=VISION_END)


def _images(seed: int, sizes: list[tuple[int, int]]) -> list[ImageInput]:
    g = torch.Generator().manual_seed(seed)
    return [ImageInput(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g), 1 / 255, MEAN, STD)
            for h, w in sizes]


def _prompt(seed: int, images: list[ImageInput]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, 490, (n,), generator=g).tolist()  # noqa: E731
    prompt = text(5)
    for i, image in enumerate(images):
        height, width = image.rgb.shape[:2]
        prompt += [VISION_START, *[IMAGE] * (height // PIXELS_PER_TOKEN * (width // PIXELS_PER_TOKEN)), VISION_END]
        prompt += text(4 + i)
    return prompt


def _hf_inputs(images: list[ImageInput]) -> dict:
    """What transformers' image processor makes of the same pixels (no resizing: they fit its grid)."""
    if not images:
        return {}
    processor = transformers.Qwen2VLImageProcessorPil(do_resize=False, patch_size=4, merge_size=2,
                                                      temporal_patch_size=2, image_mean=list(MEAN), image_std=list(STD))
    out = processor(images=[Image.fromarray(image.rgb.numpy()) for image in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _hf_logits(model, ids: list[int], images: list[ImageInput]) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
                     **_hf_inputs(images)).logits[0, -1]


def _hf_greedy(model, prompt: list[int], images: list[ImageInput]) -> list[int]:
    return hf_greedy(lambda ids: _hf_logits(model, ids, images), prompt, MAX_NEW_TOKENS)


def _requests(seed: int) -> Requests:
    three, one = _images(seed, SIZES), _images(seed + 1, [(24, 56)])
    return {"three": (_prompt(seed, three), three), "one": (_prompt(seed + 1, one), one),
            "text": (_prompt(seed, []), [])}


def _assert_transformers_tokens(engine, model, requests: Requests) -> None:
    assert_transformers_tokens(engine, requests, lambda prompt, images: _hf_greedy(model, prompt, images),
                               MAX_NEW_TOKENS)


def test_image_rows_match_transformers_image_features(qwen_vl):
    path, model = qwen_vl
    encoder = image_engine(path).runner.image_encoder
    images = _images(1, SIZES)
    with torch.no_grad():
        features = model.model.get_image_features(**_hf_inputs(images))
    # Qwen3-VL's DeepStack rows beside the input's, layer by layer.
    deepstack = getattr(features, "deepstack_features", None) or []
    ref = [torch.cat([rows, *(layer[i] for layer in deepstack)], dim=-1)
           for i, rows in enumerate(features.pooler_output)]
    ours = encoder.encode([image.pixels() for image in images])
    for (height, width), rows, expected in zip(SIZES, ours, ref, strict=True):
        assert rows.shape == (height // PIXELS_PER_TOKEN * (width // PIXELS_PER_TOKEN), 64 * (1 + len(deepstack)))
        assert (rows - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("budget", [512, 16, 21])
def test_greedy_tokens_with_images_match_transformers(qwen_vl, budget):
    path, model = qwen_vl
    requests = _requests(2)
    _assert_transformers_tokens(image_engine(path, max_num_batched_tokens=budget), model, requests)


def test_a_text_model_split_across_ranks_gives_transformers_tokens_with_images(qwen_vl, tmp_path):
    """The image encoder whole on rank 0, its rows (and DeepStack's) handed to every rank with the step;
    Qwen3-VL-MoE's fused experts split along their width whichever way round they are stored."""
    path, model = qwen_vl
    engine = image_engine(path, max_num_batched_tokens=16, tensor_parallel_size=2)
    _assert_transformers_tokens(engine, model, _requests(2))
    engine.close()
    if (released := _as_released(path, tmp_path)) is not None:
        engine = image_engine(released, max_num_batched_tokens=16, tensor_parallel_size=2)
        _assert_transformers_tokens(engine, model, _requests(2))
        engine.close()


def test_images_given_as_their_rows_give_the_tokens_their_pixels_give(qwen_vl):
    """vLLM's image_embeds: each image given as transformers' tower and merger's rows for it, at the size that
    places them (their multimodal RoPE positions): transformers' greedy tokens for the pixels, in one chunk or
    many. Qwen3-VL's images add DeepStack rows to its first layers: each image's are given beside its own rows, as
    vLLM takes them."""
    path, model = qwen_vl
    requests = _requests(3)
    with torch.no_grad():
        features = model.model.get_image_features(**_hf_inputs(requests["three"][1]))
    rows = list(features.pooler_output)
    levels = getattr(features, "deepstack_features", None) or []  # each level's rows, split by image
    rows = [torch.cat([own, *(level[i] for level in levels)], dim=-1) for i, own in enumerate(rows)]
    given = [ImageRows(own, tuple(image.rgb.shape)) for own, image in zip(rows, requests["three"][1], strict=True)]
    engine = image_engine(path, max_num_batched_tokens=16)
    assert greedy_outputs(engine, {"rows": (requests["three"][0], {"images": given})}, MAX_NEW_TOKENS)["rows"] == \
        _hf_greedy(model, *requests["three"])
    with pytest.raises(ValueError, match=f"needs 24 rows of {64 * (1 + len(levels))} floats"):
        engine.add_request("short", requests["three"][0], SamplingParams(max_tokens=2),
                           images=[ImageRows(given[0].rows[:-1], given[0].shape), *given[1:]])


@pytest.mark.parametrize("budget", [512, 16])
def test_first_and_later_token_logprobs_with_images_match_transformers(qwen_vl, budget):
    """Logprobs of the first token and of the third (two decode steps on, at positions past the images' larger
    sides): a position off by one, an image's rows transposed, would leave tokens but not these numbers."""
    path, model = qwen_vl
    images = _images(7, SIZES)
    prompt = _prompt(7, images)
    assert_logprobs_match(image_engine(path, max_num_batched_tokens=budget), prompt, images,
                          lambda ids: _hf_logits(model, ids, images))


def test_images_computed_again_after_a_preemption_give_the_same_tokens(qwen_vl):
    path, model = qwen_vl
    requests = {}
    for i in range(2):  # 64-token prompts: both admitted into 8 of the 9 pages, both past their 4th within 3 tokens
        images = _images(5 + i, [(32, 32), (16, 24)])
        prompt = _prompt(5 + i, images)
        requests[f"r{i}"] = (padded(prompt, 64), images)
    engine = image_engine(path, num_kv_blocks=9, max_num_batched_tokens=128)
    _assert_transformers_tokens(engine, model, requests)
    assert engine.scheduler.num_preemptions > 0


def _decoded_with_pixels_withheld(path, requests: Requests, max_tokens: dict[str, int]) -> dict:
    """Each request prefilled by one engine and decoded by another from a copy of its pages, which has its
    images' sizes and digests but not their pixels (a decode worker's, as the gateway sends them); the
    decoding one has 9 pages, so the second request is preempted at its first step. Its outputs by id."""
    decode = image_engine(path, num_kv_blocks=9, max_num_batched_tokens=128)
    outputs = decoded_from_handed_over_pages(image_engine(path), decode, {
        request_id: (prompt, max_tokens[request_id], {"images": images},
                     {"images": [WithheldImage(image.shape, image.digest) for image in images]})
        for request_id, (prompt, images) in requests.items()})
    assert decode.scheduler.num_preemptions == 1
    assert not any(out.step_times.image_encodes for out in outputs.values())  # no pixels to encode
    return outputs


def _two_requests() -> Requests:
    """Two 64-token prompts (4 pages each), their second image's tokens past the 32nd."""
    requests = {}
    for i in range(2):
        images = _images(7 + i, [(32, 32), (16, 24)])
        prompt = _prompt(7 + i, images)
        requests[f"r{i}"] = (padded(prompt, 64), images)
    return requests


def test_a_request_decoded_without_its_pixels_goes_on_from_its_cached_pages_after_a_preemption(qwen_vl):
    """Preempted, its pages freed but kept by the prefix cache while the other request ends: readmitted from
    them, it computes no image again and makes transformers' tokens."""
    path, model = qwen_vl
    requests = _two_requests()
    outputs = _decoded_with_pixels_withheld(path, requests, {"r0": MAX_NEW_TOKENS, "r1": MAX_NEW_TOKENS})
    for request_id, (prompt, images) in requests.items():
        assert outputs[request_id].finish_reason == "length"
        assert outputs[request_id].token_ids == _hf_greedy(model, prompt, images), request_id


def test_a_request_decoded_without_its_pixels_ends_withheld_where_its_cache_lost_its_images(qwen_vl):
    """The other request's 40 tokens take two of its cached pages: its images' tokens cannot be computed
    again without their pixels, so it ends "withheld" (its caller resumes it with them), its pages freed."""
    path, model = qwen_vl
    requests = _two_requests()
    outputs = _decoded_with_pixels_withheld(path, requests, {"r0": 40, "r1": MAX_NEW_TOKENS})
    assert outputs["r0"].finish_reason == "length" and len(outputs["r0"].token_ids) == 40
    prompt, images = requests["r1"]
    assert outputs["r1"].finish_reason == "withheld"
    assert outputs["r1"].token_ids == _hf_greedy(model, prompt, images)[:1]  # its first, from the prefill


def test_images_the_prompt_does_not_place_are_refused(qwen_vl):
    path, _ = qwen_vl
    engine = image_engine(path)
    params = SamplingParams(max_tokens=4)
    image = _images(6, [(32, 48)])
    refusals = {
        "an image takes 24 image tokens, the prompt has 20": ([1, VISION_START, *[IMAGE] * 20, VISION_END], image),
        "sides of whole multiples of 8 pixels": (_prompt(6, image), _images(6, [(32, 44)])),
    }
    for message, (prompt, images) in refusals.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", prompt, params, images=images)
    assert not engine.has_unfinished_requests()


def test_qwen3_vl_moe_experts_as_released_give_the_same_tokens(qwen_vl, tmp_path, request):
    """Released Qwen3-VL-MoE checkpoints store each layer's experts [E, in, out]; transformers 5 saves them
    [E, out, in] (the fixture's): both load alike."""
    if request.node.callspec.params["qwen_vl"] != "qwen3_vl_moe":
        pytest.skip("Qwen3-VL-MoE's experts only")
    path, model = qwen_vl
    requests = _requests(4)
    _assert_transformers_tokens(image_engine(_as_released(path, tmp_path)), model, requests)


def _as_released(path, tmp_path):
    """A copy of a Qwen3-VL-MoE checkpoint with its experts stored as released, [E, in, out] (None for another
    model's)."""
    tensors = load_file(path / "model.safetensors")
    released = {name: t.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                else t for name, t in tensors.items()}
    if all(t.shape == tensors[n].shape for n, t in released.items()):
        return None
    for name in ("config.json", "generation_config.json"):
        shutil.copy(path / name, tmp_path / name)
    save_file(released, tmp_path / "model.safetensors")
    return tmp_path

