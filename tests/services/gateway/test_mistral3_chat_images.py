"""Mistral 3's images through the mesh, by the `openai` client: a tiny Mistral3ForConditionalGeneration (Pixtral
tower, projector, Mistral text model) with its tokenizer, chat template and Pixtral image processor saved by
transformers, and the PixtralProcessor settings of Mistral Small 3.1's processor_config.json. Images of other
sizes take other numbers of tokens (a row of [IMG]s a row of the image's grid, [IMG_BREAK] between rows,
[IMG_END] after), rendered by the tokenizer service and by the gateway itself; greedy tokens and their top
logprobs equal transformers' on what its image processor makes of the same images.

transformers' PixtralProcessor needs torchvision, which has no build for this torch here: the test expands the
template's [IMG] marks as that processor does (`_expanded`), from the image sizes its image processor gives."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.parity.conftest import transformers
from tests.services.gateway.image_chats import (
    MAX_TOKENS,
    assert_same_reply,
    data_url,
    greedy_chat,
    greedy_chat_by_a_local_gateway,
    greedy_logprobs,
    random_image,
    word_level_tokenizer,
)
from tests.services.gateway.mesh import running_mesh

IMAGE, BREAK, END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
MARKS = {IMAGE: 10, BREAK: 12, END: 13}
PIXELS_PER_TOKEN = 8  # the processor's patch of 4, merged 2x2
LONGEST_EDGE = 64
# Mistral Small 3.1's template, shortened: a user message's parts in turn, an image part as [IMG].
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
            "{% if message['content'] is string %}{{ message['content'] }} {% else %}"
            "{% for block in message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }} "
            "{% elif block['type'] in ['image', 'image_url'] %}[IMG]{% endif %}{% endfor %}{% endif %}[/INST] "
            "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Words w0..w489 by a word-level vocabulary of 512, Mistral's image tokens at their ids (10, 12, 13)."""
    vocab = {token: i for i, token in enumerate(SPECIALS)} | MARKS | {f"w{i}": 20 + i for i in range(490)}
    return word_level_tokenizer(vocab, [*SPECIALS, *MARKS], "<unk>", bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>")


@pytest.fixture(scope="module")
def mistral3_vlm(tmp_path_factory):
    """The model, its tokenizer and chat template, its image processor, and processor_config.json."""
    text = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      sliding_window=None, initializer_range=0.2, max_position_embeddings=2048)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, image_size=LONGEST_EDGE, patch_size=4,
                                              hidden_act="silu")
    torch.manual_seed(31)
    model = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=MARKS[IMAGE])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp("mistral3-vlm")
    model.save_pretrained(path)
    tokenizer = _tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    image_processor = transformers.PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                                                            patch_size=PIXELS_PER_TOKEN)
    image_processor.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 4, "spatial_merge_size": 2, "image_token": IMAGE,
        "image_break_token": BREAK, "image_end_token": END}))
    return path, model, tokenizer, image_processor


@pytest.fixture(scope="module")
def vlm_mesh(mistral3_vlm, tmp_path_factory):
    """Chats rendered by the tokenizer service (the gateway renders none itself)."""
    media = tmp_path_factory.mktemp("media")
    with running_mesh(mistral3_vlm[0], num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"),
                      gateway_args=("--local-prefill-max-tokens", "0", "--local-tokenize-max-chars", "0",
                                    "--allowed-local-media-path", str(media))) as mesh:
        yield mesh, media


@pytest.fixture(scope="module")
def client(vlm_mesh):
    with openai.OpenAI(base_url=f"{vlm_mesh[0].gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _expanded(text: str, image_sizes: list[tuple[int, int]]) -> str:
    """PixtralProcessor's: each [IMG] mark, in turn, made its image's rows of [IMG]s with a break after each
    row but the last, which ends with [IMG_END]."""
    pieces = text.split(IMAGE)
    out = pieces[0]
    for (height, width), after in zip(image_sizes, pieces[1:], strict=True):
        rows = [IMAGE * (width // PIXELS_PER_TOKEN)] * (height // PIXELS_PER_TOKEN)
        out += BREAK.join(rows) + END + after
    return out


def _transformers_greedy(mistral3_vlm, content: list[dict]) -> tuple[list[int], list[torch.Tensor], int]:
    """transformers' greedy tokens for a user message of `content` (image parts holding their PIL images), the
    logprobs each was drawn from, and its prompt's length."""
    _, model, tokenizer, image_processor = mistral3_vlm
    images = [part["image"] for part in content if part["type"] == "image"]
    inputs = image_processor(images=images, return_tensors="pt")
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    ids = tokenizer(_expanded(text, inputs["image_sizes"].tolist()), add_special_tokens=False,
                    return_tensors="pt")["input_ids"]
    tokens, logprobs = greedy_logprobs(lambda current: model(
        input_ids=current, pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]).logits[0, -1], ids)
    return tokens, logprobs, ids.shape[1]


def test_images_of_other_sizes_give_transformers_reply(vlm_mesh, client, mistral3_vlm):
    """A wide photo over the longest edge (scaled down to 64x24 pixels: 3 rows of 8 tokens), a small tall one
    from a file (scaled up to whole tokens: 16x40, 5 rows of 2)."""
    mesh, media = vlm_mesh
    wide, tall = random_image(1, (200, 70)), random_image(2, (13, 37))
    tall.save(media / "tall.png")
    reply = greedy_chat(client, mesh.model_name, [
        {"type": "text", "text": "w1 w2"}, {"type": "image_url", "image_url": {"url": data_url(wide)}},
        {"type": "text", "text": "w3"}, {"type": "image_url", "image_url": {"url": f"file://{media}/tall.png"}}])
    expected, logprobs, num_prompt = _transformers_greedy(mistral3_vlm, [
        {"type": "text", "text": "w1 w2"}, {"type": "image", "image": wide}, {"type": "text", "text": "w3"},
        {"type": "image", "image": tall}])
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt == 6 + 3 * 9 + 5 * 3  # the words and marks, the two grids
    mesh.assert_decode_pools_free()


def test_a_gateway_rendering_chats_itself_gives_the_same_reply(vlm_mesh, client, mistral3_vlm):
    mesh = vlm_mesh[0]
    image = random_image(3, (40, 64))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "w5 w6"}]
    reply = greedy_chat_by_a_local_gateway(mesh, content)
    expected, logprobs, _ = _transformers_greedy(mistral3_vlm, [{"type": "image", "image": image},
                                                                {"type": "text", "text": "w5 w6"}])
    assert_same_reply(reply, expected, logprobs)
    assert reply.choices[0].token_ids == greedy_chat(client, mesh.model_name, content).choices[0].token_ids


def test_the_same_image_again_hits_the_prefix_cache_and_another_of_its_size_does_not(vlm_mesh, client):
    mesh = vlm_mesh[0]
    content = lambda seed: [{"type": "image_url", "image_url": {"url": data_url(random_image(seed, (64, 64)))}},  # noqa: E731
                            {"type": "text", "text": " ".join(f"w{i}" for i in range(30))}]
    first = greedy_chat(client, mesh.model_name, content(4))
    again = greedy_chat(client, mesh.model_name, content(4))
    other = greedy_chat(client, mesh.model_name, content(5))
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].token_ids == first.choices[0].token_ids


def test_an_image_too_narrow_to_make_a_token_is_refused(vlm_mesh, client):
    mesh = vlm_mesh[0]
    with pytest.raises(openai.BadRequestError, match="too narrow"):
        greedy_chat(client, mesh.model_name,
                    [{"type": "image_url", "image_url": {"url": data_url(random_image(6, (400, 1)))}}])
    mesh.assert_decode_pools_free()


def test_tokenize_and_count_tokens_count_an_images_grid(vlm_mesh, client):
    """vLLM's /tokenize and Anthropic's count_tokens read a chat's images to count their tokens, as many as
    their sizes make (here 2 rows of 5 tokens)."""
    mesh = vlm_mesh[0]
    url = data_url(random_image(7, (40, 16)))
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w8"}]
    prompt_tokens = greedy_chat(client, mesh.model_name, content).usage.prompt_tokens
    assert prompt_tokens == 4 + 2 * 6  # <s> [INST] w8 [/INST], and the image
    tokenized = httpx.post(f"{mesh.gateway.base_url}/tokenize",
                           json={"model": mesh.model_name, "messages": [{"role": "user", "content": content}]}).json()
    assert tokenized["count"] == prompt_tokens and tokenized["tokens"].count(MARKS[IMAGE]) == 10
    media_type, data = url.removeprefix("data:").split(";base64,")
    counted = httpx.post(f"{mesh.gateway.base_url}/v1/messages/count_tokens", json={
        "model": mesh.model_name, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
            {"type": "text", "text": "w8"}]}]}).json()
    assert counted["input_tokens"] == prompt_tokens


def test_a_truncated_conversation_keeps_its_last_turns_images(vlm_mesh, client):
    """The Responses API's truncation "auto" counts each turn's images by their sizes, and what is left out
    takes its images with it: the reply is chat's to the last turn alone."""
    mesh = vlm_mesh[0]
    first, last = data_url(random_image(8, (64, 64))), data_url(random_image(9, (24, 48)))
    long_text = " ".join(f"w{i % 400}" for i in range(1990))  # with its image, more than the context of 2048
    response = client.responses.create(model=mesh.model_name, max_output_tokens=MAX_TOKENS, temperature=0,
                                       truncation="auto", extra_body={"ignore_eos": True}, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": first},
                                     {"type": "input_text", "text": long_text}]},
        {"role": "assistant", "content": "w1"},
        {"role": "user", "content": [{"type": "input_image", "image_url": last},
                                     {"type": "input_text", "text": "w2"}]}])
    expected = greedy_chat(client, mesh.model_name, [{"type": "image_url", "image_url": {"url": last}},
                                               {"type": "text", "text": "w2"}])
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens
