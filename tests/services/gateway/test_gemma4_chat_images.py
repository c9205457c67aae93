"""A chat's images through the mesh for Gemma 4, by the `openai` client: a tiny Gemma4ForConditionalGeneration, its
tokenizer (Gemma 4's image marks) and image processor saved by transformers. The gateway resizes each image to its
budget of patches and the tokenizer service writes its run of tokens as Gemma4Processor does; the greedy tokens and
their logprobs equal transformers' on the same prompt and pixels (Gemma4ImageProcessorPil's)."""
from __future__ import annotations

import openai
import pytest
import torch

from tests.parity.conftest import transformers
from tests.services.gateway.image_chats import (
    assert_same_reply,
    data_url,
    greedy_chat,
    greedy_logprobs,
    random_image,
    rendering_mesh,
    word_level_tokenizer,
)

IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE = 500, 498, 499
MARKS = {"<|image>": BEGIN_IMAGE, "<image|>": END_IMAGE, "<|image|>": IMAGE_TOKEN}
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
# Gemma's template, shortened: a message's parts in turn, an image part as the image's mark.
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }} "
            "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
            "{% for item in message['content'] %}{% if item['type'] == 'image' %}<|image|> "
            "{% elif item['type'] == 'text' %}{{ item['text'] | trim }} {% endif %}{% endfor %}{% endif %}"
            "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}")


@pytest.fixture(scope="module")
def gemma4_vlm(tmp_path_factory):
    """The model, its tokenizer and its image processor (4-pixel patches, 2x2 a token, 70 tokens at most), saved as
    transformers saves them."""
    text = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, vocab_size=512, vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
        num_kv_shared_layers=1, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2,
        use_bidirectional_attention="vision", initializer_range=0.2, max_position_embeddings=2048, pad_token_id=0)
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4,
                                             pooling_kernel_size=2, position_embedding_size=64)
    torch.manual_seed(44)
    model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None, image_token_id=IMAGE_TOKEN,
        boi_token_id=BEGIN_IMAGE, eoi_token_id=END_IMAGE, eos_token_id=1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "projection" in name or "position_embedding" in name:
                p.add_(torch.randn_like(p) * 0.3)
    words = SPECIALS + [f"w{i}" for i in range(490)] + ["user", "model"]
    tokenizer = word_level_tokenizer(
        {token: i for i, token in enumerate(words)} | MARKS, [*SPECIALS, *MARKS], "<pad>", bos_token="<bos>",
        eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"})
    tokenizer.chat_template = TEMPLATE
    processor = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    path = tmp_path_factory.mktemp("gemma4-vlm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path, model, tokenizer, processor


def _transformers_greedy(gemma4_vlm, content: list[dict], images) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for a user message of `content` with `images` (their parts' PIL images), as
    Gemma4Processor writes its prompt (each image's mark its run of soft tokens between its begin and end marks),
    and the logprobs each was drawn from."""
    _, model, tokenizer, processor = gemma4_vlm
    pixels = processor(images=images, return_tensors="pt")
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    pieces = text.split("<|image|>")
    runs = [f"<|image>{'<|image|>' * int(n)}<image|>" for n in pixels["num_soft_tokens_per_image"]]
    ids = tokenizer("".join(p + r for p, r in zip(pieces, [*runs, ""])), add_special_tokens=False,
                    return_tensors="pt")["input_ids"]
    return greedy_logprobs(lambda current: model(
        input_ids=current, pixel_values=pixels["pixel_values"], image_position_ids=pixels["image_position_ids"],
        mm_token_type_ids=(current == IMAGE_TOKEN).long()).logits[0, -1], ids)


@pytest.fixture(scope="module")
def client(gemma4_vlm):
    with rendering_mesh(gemma4_vlm[0]) as mesh:
        with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            yield client, mesh


def test_images_of_any_size_get_transformers_reply(gemma4_vlm, client):
    """A wide photo scaled down to its budget and a small one scaled up, in one message: each its own run."""
    client, mesh = client
    images = [random_image(1, (300, 120)), random_image(2, (20, 36))]
    content = [{"type": "text", "text": "w5 w6"}, {"type": "image"}, {"type": "text", "text": "w7"},
               {"type": "image"}, {"type": "text", "text": "w8 w9"}]
    expected, logprobs = _transformers_greedy(gemma4_vlm, content, images)
    served = [part if part["type"] == "text" else {"type": "image_url", "image_url": {"url": data_url(image)}}
              for part, image in zip(content, [None, images[0], None, images[1], None], strict=True)]
    reply = greedy_chat(client, mesh.model_name, served)
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens > 2 * 35  # both runs: the wide one's 20 x 8 squares, capped at 70
    mesh.assert_decode_pools_free()


def test_a_requests_budget_of_soft_tokens_is_its_own(gemma4_vlm, client):
    """mm_processor_kwargs' max_soft_tokens, as transformers' processor takes it: more tokens for the same image."""
    client, mesh = client
    image = random_image(3, (300, 120))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "w1"}]
    small = greedy_chat(client, mesh.model_name, content)
    large = greedy_chat(client, mesh.model_name, content, mm_processor_kwargs={"max_soft_tokens": 140})
    assert large.usage.prompt_tokens - small.usage.prompt_tokens > 50
    with pytest.raises(openai.BadRequestError, match="max_soft_tokens must be one of 70, 140, 280, 560, 1120"):
        greedy_chat(client, mesh.model_name, content, mm_processor_kwargs={"max_soft_tokens": 100})
    mesh.assert_decode_pools_free()
