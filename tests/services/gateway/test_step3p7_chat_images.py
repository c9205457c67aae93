"""Step-3.7's images through the mesh, by the `openai` client: a tiny Step3p7ForConditionalGeneration with its image
processor's settings (a global view of 112 pixels, local crops of 56 here). The greedy tokens and top logprobs equal
transformers' model's on the prompt Step3p7Processor writes (each image its local crops' runs between patch marks,
row by row, then its global view's run) and the views' pixels (which test_step3p7_views.py holds to
Step3p7ImageProcessor's where torchvision imports)."""
from __future__ import annotations

import json
import types

import httpx
import openai
import pytest
import torch

from services.gateway.step3p7_views import LocalCrops
from tests.parity.test_step3p7_images import GLOBAL, IMAGE_TOKEN, LOCAL, tiny_step3p7
from tests.services.gateway.image_chats import (
    assert_same_reply,
    data_url,
    greedy_chat,
    greedy_logprobs,
    image_limited_mesh,
    random_image,
    word_level_tokenizer,
)

SPECIALS = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<|user|>": 3, "<|assistant|>": 4, "<im_patch>": IMAGE_TOKEN,
            "<patch_start>": 501, "<patch_end>": 502, "<patch_newline>": 503, "<im_start>": 504, "<im_end>": 505}
# Step-3.7's template, shortened: a message's parts in turn, an image part as the image's mark.
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> "
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for item in message['content'] %}{% if item['type'] == 'image' %}<im_patch>"
            "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %} "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@pytest.fixture(scope="module")
def step3p7_vlm(tmp_path_factory):
    """The model, its tokenizer and template, and its image processor's settings."""
    model = tiny_step3p7(62, eos_token_id=2, pad_token_id=0, bos_token_id=1, max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("step3p7-vlm")
    model.save_pretrained(path)
    words = {f"w{i}": 10 + i for i in range(400)} | {"user": 450, "assistant": 451}
    tokenizer = word_level_tokenizer(SPECIALS | words, list(SPECIALS), "<pad>", bos_token="<bos>", eos_token="<eos>",
                                     pad_token="<pad>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Step3p7ImageProcessor", "processor_class": "Step3p7Processor",
        "size": {"height": GLOBAL, "width": GLOBAL}, "patch_size": LOCAL, "max_image_size": 3024,
        "image_mean": MEAN, "image_std": STD, "rescale_factor": 1 / 255, "resample": 2}))
    # (as released: the image processor's sizes, which the prompt's runs depend on, in preprocessor_config.json alone)
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Step3p7Processor"}))
    return path, model, tokenizer


@pytest.fixture(scope="module")
def mesh(step3p7_vlm):
    """Workers taking at most 2 images a prompt: an image's crops and global view go with it, not counted."""
    with image_limited_mesh(step3p7_vlm[0], 2) as mesh:
        yield mesh


def _transformers_greedy(step3p7_vlm, content: list[dict]) -> tuple[list[int], list[torch.Tensor], int]:
    """transformers' greedy tokens for one user message of `content` (image parts holding PIL images), the logprobs
    each was drawn from, and its prompt's length: the template rendered by the tokenizer, each image's mark made its
    views' tokens by Step3p7Processor's own function, its pixels as its processor cuts them."""
    from transformers.models.step3p7.processing_step3p7 import Step3p7Processor

    from engine.prompt_images import ImageInput

    _, model, tokenizer = step3p7_vlm
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    marks = types.SimpleNamespace(patch_feature_placeholder="<im_patch>" * (LOCAL // 56) ** 2,
                                  image_feature_placeholder="<im_patch>" * (GLOBAL // 56) ** 2)
    pieces, globals_, locals_, counts = text.split("<im_patch>"), [], [], []
    prompt = pieces[0]
    for part, after in zip([p for p in content if p["type"] == "image"], pieces[1:], strict=True):
        crops, whole, columns = LocalCrops(GLOBAL, LOCAL).views(part["image"].convert("RGB"))
        newlines = [i % columns == columns - 1 and i < len(crops) - columns for i in range(len(crops))]
        prompt += Step3p7Processor.replace_image_token(marks, {"num_local_patches": [len(crops)],
                                                               "patch_newline_masks": [newlines]}, 0) + after
        globals_.append(ImageInput(torch.from_numpy(whole.copy()), 1 / 255, MEAN, STD).pixels())
        locals_ += [ImageInput(torch.from_numpy(crop.copy()), 1 / 255, MEAN, STD).pixels() for crop in crops]
        counts.append(len(crops))
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    tokens, logprobs = greedy_logprobs(lambda current: model(
        input_ids=current, pixel_values=torch.stack(globals_), num_local_patches=counts,
        pixel_values_local=torch.stack(locals_) if locals_ else None).logits[0, -1], ids)
    return tokens, logprobs, ids.shape[1]


def test_images_with_crops_in_rows_and_without_give_transformers_greedy_reply(mesh, step3p7_vlm):
    """A 150x130 image (3x3 local crops, two newlines, and its global view) and a 50x40 one (its global view alone):
    the reply transformers'; /tokenize counts the same prompt; a third image is over the limit, the crops not
    counted."""
    grid, small = random_image(1, (150, 130)), random_image(2, (50, 40))
    content = [{"type": "text", "text": "w5 w6"}, {"type": "image_url", "image_url": {"url": data_url(grid)}},
               {"type": "text", "text": "w7"}, {"type": "image_url", "image_url": {"url": data_url(small)}}]
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        reply = greedy_chat(client, mesh.model_name, content)
        with pytest.raises(openai.BadRequestError, match="limit of 2"):
            greedy_chat(client, mesh.model_name, [*content, content[1]])
    expected, logprobs, num_prompt = _transformers_greedy(step3p7_vlm, [
        {"type": "text", "text": "w5 w6"}, {"type": "image", "image": grid}, {"type": "text", "text": "w7"},
        {"type": "image", "image": small}])
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt > 9 * 3 + 2 + 2 * 6
    counted = httpx.post(f"{mesh.gateway.base_url}/tokenize", json={
        "model": mesh.model_name, "messages": [{"role": "user", "content": content}]})
    assert counted.status_code == 200 and counted.json()["count"] == num_prompt
    mesh.assert_decode_pools_free()
