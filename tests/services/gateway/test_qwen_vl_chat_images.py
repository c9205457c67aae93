"""Qwen2.5-VL's and Qwen3-VL's images through the mesh, by the `openai` client: a tiny
Qwen2_5_VLForConditionalGeneration and Qwen3VLForConditionalGeneration with their tokenizer, chat template and
Qwen2-VL image processor saved by transformers. Images are smart-resized to whole
8-pixel squares (the tiny tower's 4-pixel patches merged 2x2) within the processor's pixel bounds, and take one
run of <|image_pad|> tokens a square, placed by multimodal RoPE; greedy tokens and their top logprobs equal
transformers' on what its image processor makes of the same images.

transformers' Qwen2_5_VLProcessor and Qwen3VLProcessor need torchvision (their video processors), which has no
build for this torch here: the test expands the template's <|image_pad|> marks as those processors do
(`_expanded`)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from tests.parity.conftest import transformers
from tests.parity.images import QWEN_VL
from tests.services.gateway.image_chats import (
    MAX_TOKENS,
    assert_same_reply,
    data_url,
    greedy_chat,
    greedy_chat_by_a_local_gateway,
    greedy_logprobs,
    qwen_vl_tokenizer,
    random_image,
    rendering_mesh,
    saved_tensor,
)
from tests.services.gateway.mesh import metric_value, running_mesh

IMAGE, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
MARKS = {VISION_START: 498, VISION_END: 499, IMAGE: 500}
PIXELS_PER_TOKEN = 8
MIN_PIXELS, MAX_PIXELS = 16 * 16, 40 * 8 * 8  # at most 40 squares an image
# Qwen2-VL's template, shortened: a message's parts in turn, an image part as its vision marks.
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }} {% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
            "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif content['type'] == 'text' %}{{ content['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> "
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


# (North's marks are its own: tests/unit/test_video_tokens.py; its images test_qwen_vl_images.py's)
@pytest.fixture(scope="module", params=[kind for kind in QWEN_VL if kind != "cohere_compass"])
def qwen_vlm(request, tmp_path_factory):
    config_class, model_class, text, vision = QWEN_VL[request.param]
    torch.manual_seed(51)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(
        text_config=text, vision_config=vision, image_token_id=MARKS[IMAGE],
        vision_start_token_id=MARKS[VISION_START], vision_end_token_id=MARKS[VISION_END])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tokenizer = qwen_vl_tokenizer(MARKS, TEMPLATE)
    tokenizer.save_pretrained(path)
    image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    image_processor.save_pretrained(path)
    return path, model, tokenizer, image_processor


@pytest.fixture(scope="module")
def vlm_mesh(qwen_vlm):
    with rendering_mesh(qwen_vlm[0]) as mesh:
        yield mesh


def _expanded(text: str, grids: list[list[int]]) -> str:
    """Qwen2_5_VLProcessor's: each <|image_pad|> mark, in turn, made one for each square of its image (t * h * w
    patches over the 2x2 merge)."""
    pieces = text.split(IMAGE)
    return pieces[0] + "".join(IMAGE * (t * h * w // 4) + after for (t, h, w), after in zip(grids, pieces[1:],
                                                                                            strict=True))


def _transformers_greedy(qwen_vlm, content: list[dict], max_tokens: int = MAX_TOKENS, logit_bias: float = 0.0,
                         **processor_kwargs) -> tuple[list[int], list[torch.Tensor], int]:
    """`logit_bias`: added to the image token's logit (transformers takes none the model makes)."""
    _, model, tokenizer, image_processor = qwen_vlm
    inputs = image_processor(images=[part["image"] for part in content if part["type"] == "image"],
                             return_tensors="pt", **processor_kwargs)
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(_expanded(text, inputs["image_grid_thw"].tolist()), add_special_tokens=False,
                    return_tensors="pt")["input_ids"]
    def last_logits(current: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=current, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                       mm_token_type_ids=(current == MARKS[IMAGE]).int()).logits[0, -1]
        logits[MARKS[IMAGE]] += logit_bias
        return logits

    tokens, logprobs = greedy_logprobs(last_logits, ids, max_tokens)
    return tokens, logprobs, ids.shape[1]


def test_images_of_other_sizes_give_transformers_reply(vlm_mesh, qwen_vlm):
    """A wide photo over the pixel bound (scaled down to at most 40 squares), a tiny one under it (scaled up)."""
    wide, tiny = random_image(1, (300, 90)), random_image(2, (9, 13))
    with openai.OpenAI(base_url=f"{vlm_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        reply = greedy_chat(client, vlm_mesh.model_name, [
            {"type": "text", "text": "w1 w2"}, {"type": "image_url", "image_url": {"url": data_url(wide)}},
            {"type": "text", "text": "w3"}, {"type": "image_url", "image_url": {"url": data_url(tiny)}}])
    expected, logprobs, num_prompt = _transformers_greedy(qwen_vlm, [
        {"type": "text", "text": "w1 w2"}, {"type": "image", "image": wide}, {"type": "text", "text": "w3"},
        {"type": "image", "image": tiny}])
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt
    vlm_mesh.assert_decode_pools_free()


def test_a_gateway_rendering_chats_itself_gives_the_same_reply(vlm_mesh, qwen_vlm):
    image = random_image(3, (40, 64))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "w5 w6"}]
    reply = greedy_chat_by_a_local_gateway(vlm_mesh, content)
    expected, logprobs, _ = _transformers_greedy(qwen_vlm, [{"type": "image", "image": image},
                                                            {"type": "text", "text": "w5 w6"}])
    assert_same_reply(reply, expected, logprobs)


def test_an_image_given_as_its_encoders_rows_and_grid_gets_transformers_reply(vlm_mesh, qwen_vlm):
    """vLLM's image_embeds part for Qwen-VL (--enable-mm-embeds): transformers' tower and merger's rows for an
    image and its image_grid_thw, given in its place, get transformers' reply to the image (its tokens placed by
    the grid, their RoPE positions too). Qwen3-VL's rows carry its DeepStack layers' beside them, as vLLM takes
    them; without those they are a 400 naming the width."""
    _, model, _, image_processor = qwen_vlm
    image = random_image(6, (72, 40))
    inputs = image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_grid_thw=inputs["image_grid_thw"])
    rows, deepstack = features.pooler_output[0], getattr(features, "deepstack_features", None)
    grid = saved_tensor(inputs["image_grid_thw"])
    if deepstack:
        part = {"type": "image_embeds", "image_embeds": {"image_embeds": saved_tensor(rows), "image_grid_thw": grid}}
        with pytest.raises(openai.BadRequestError, match=rf"\[tokens, {rows.shape[1] * (1 + len(deepstack))}\] "
                                                         r"tensor \(the model's hidden size for its rows, then for "
                                                         "each DeepStack layer's"):
            greedy_chat_by_a_local_gateway(vlm_mesh, [part], "--enable-mm-embeds")
        rows = torch.cat([rows, *(level[0] for level in deepstack)], dim=-1)  # each level split by image
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": saved_tensor(rows), "image_grid_thw": grid}}
    content = [{"type": "text", "text": "w2"}, part]
    reply = greedy_chat_by_a_local_gateway(vlm_mesh, content, "--enable-mm-embeds")
    expected, logprobs, num_prompt = _transformers_greedy(qwen_vlm, [{"type": "text", "text": "w2"},
                                                                     {"type": "image", "image": image}])
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt
    vlm_mesh.assert_decode_pools_free()


def test_a_gateways_mm_processor_kwargs_bound_an_images_tokens(vlm_mesh, qwen_vlm):
    """vLLM's --mm-processor-kwargs '{"max_pixels": N}': a photo smart-resized within 16 squares, not the
    processor's 40, as transformers' processor resizes it with the same bound."""
    image = random_image(4, (300, 200))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "w9"}]
    reply = greedy_chat_by_a_local_gateway(vlm_mesh, content, "--mm-processor-kwargs",
                                           json.dumps({"max_pixels": 16 * 8 * 8}))
    expected, logprobs, num_prompt = _transformers_greedy(
        qwen_vlm, [{"type": "image", "image": image}, {"type": "text", "text": "w9"}], max_pixels=16 * 8 * 8)
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt <= 8 + 16


def test_a_requests_mm_processor_kwargs_bound_its_images_tokens(vlm_mesh, qwen_vlm):
    """vLLM's per-request mm_processor_kwargs over the processor's (and the cache keeps the image read each way
    apart); settings it has not are a 400 naming them."""
    image = random_image(5, (300, 200))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "w9"}]
    with openai.OpenAI(base_url=f"{vlm_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        whole = greedy_chat(client, vlm_mesh.model_name, content)
        bounded = greedy_chat(client, vlm_mesh.model_name, content, mm_processor_kwargs={"max_pixels": 9 * 8 * 8})
        for kwargs, message in [({"num_frames": 2}, "'num_frames' is not served"),
                                ({"max_pixels": 0}, "positive integer"), ({"size": {"height": 64}}, "takes no height")]:
            with pytest.raises(openai.BadRequestError, match=message) as refused:
                greedy_chat(client, vlm_mesh.model_name, content, mm_processor_kwargs=kwargs)
            assert refused.value.body["param"] == "mm_processor_kwargs"
    expected, logprobs, num_prompt = _transformers_greedy(
        qwen_vlm, [{"type": "image", "image": image}, {"type": "text", "text": "w9"}], max_pixels=9 * 8 * 8)
    assert_same_reply(bounded, expected, logprobs)
    assert bounded.usage.prompt_tokens == num_prompt < whole.usage.prompt_tokens
    vlm_mesh.assert_decode_pools_free()


def test_images_over_a_message_to_a_worker_are_refused_whole(vlm_mesh):
    """A prompt's images travel to each worker in one gRPC message: past --max-message-bytes (less room for the
    rest of the request) they are a 413 naming the flag and max_pixels, before any worker is asked."""
    image = random_image(6, (900, 700))  # 1.8 MiB of pixels with max_pixels raised
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "w1"}]
    with pytest.raises(openai.APIStatusError) as refused:
        greedy_chat_by_a_local_gateway(vlm_mesh, content, "--max-message-bytes", str(2 * 2**20),
                                       "--mm-processor-kwargs", json.dumps({"max_pixels": 900 * 700}))
    assert refused.value.status_code == 413 and "--max-message-bytes" in refused.value.message
    assert "max_pixels" in refused.value.message
    vlm_mesh.assert_decode_pools_free()


RESUMES = "baton_gateway_decode_resumes_total"
PAGES = 12  # of 16 tokens: a 32-token chat's 160 greedy tokens take them all


@pytest.fixture(scope="module")
def small_pool_mesh(qwen_vlm):
    """A decode worker of PAGES pages, behind one prefill worker."""
    if type(qwen_vlm[1]).__name__ != "Qwen2_5_VLForConditionalGeneration":
        pytest.skip("one model's: what the gateway sends a decode worker is alike for all")
    with running_mesh(qwen_vlm[0], num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"),
                      decode_args=("--kv-blocks", str(PAGES)),
                      gateway_args=("--local-prefill-max-tokens", "0", "--local-tokenize-max-chars", "0")) as mesh:
        yield mesh



def test_a_chat_its_decode_worker_preempted_without_its_pixels_is_resumed_with_them(small_pool_mesh, qwen_vlm):
    """The gateway sends a decode worker no pixels. Two chats whose replies each fill its pool: one is
    preempted, and the other's last pages take its cached ones, images' KV and all; without their pixels its
    worker cannot compute them again, so it ends the stream and the gateway resumes the chat there, images
    given again (GenerateLocally). Both replies are transformers' 160 greedy tokens (the image token
    biased out: transformers reads every image token as an image's)."""
    images = [random_image(20 + i, (32, 32)) for i in range(2)]
    texts = [" ".join(f"w{10 * i + k}" for k in range(9)) for i in range(2)]
    contents = [[{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": text}]
                for image, text in zip(images, texts, strict=True)]
    before = metric_value(small_pool_mesh.gateway.base_url, RESUMES)
    with openai.OpenAI(base_url=f"{small_pool_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda content: client.chat.completions.create(
                model=small_pool_mesh.model_name, messages=[{"role": "user", "content": content}],
                max_tokens=PAGES * 16 - 32, temperature=0, logit_bias={str(MARKS[IMAGE]): -100},
                extra_body={"ignore_eos": True, "return_token_ids": True}), contents))
    assert metric_value(small_pool_mesh.gateway.base_url, RESUMES) - before >= 1
    for image, text, reply in zip(images, texts, replies, strict=True):
        expected, _, num_prompt = _transformers_greedy(qwen_vlm, [{"type": "image", "image": image},
                                                                  {"type": "text", "text": text}],
                                                       max_tokens=PAGES * 16 - 32, logit_bias=-100)
        assert reply.usage.prompt_tokens == num_prompt == 32
        assert reply.choices[0].token_ids == expected
    small_pool_mesh.assert_decode_pools_free(num_tokens=PAGES * 16 - 1)
