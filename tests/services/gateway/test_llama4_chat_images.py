"""Llama 4's images through the mesh, by the `openai` client: a tiny Llama4ForConditionalGeneration with Llama 4's
chat template and its image processor's settings (tiles of 56 pixels here). The greedy tokens and top logprobs
equal transformers' model's on the prompt Llama4Processor writes (each image a run of tokens a tile, between
tile separators, then its global tile's run) and the tiles' pixels (which test_llama4_tiles.py holds to
Llama4ImageProcessor's where torchvision imports)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from services.gateway.llama4_tiles import TileCanvas
from tests.parity.test_llama4_images import TILE, TOKENS_PER_TILE, hf_logits, tiny_llama4
from tests.services.gateway.image_chats import (
    MAX_TOKENS,
    assert_same_reply,
    data_url,
    greedy_chat,
    greedy_logprobs,
    image_limited_mesh,
    random_image,
    word_level_tokenizer,
)
from tests.services.gateway.mesh import GatewayProcess

SPECIALS = {"<|begin_of_text|>": 0, "<|eot|>": 1, "<|header_start|>": 2, "<|header_end|>": 3, "<pad>": 4,
            "<|patch|>": 500, "<|image_start|>": 501, "<|image_end|>": 502, "<|image|>": 503,
            "<|tile_x_separator|>": 504, "<|tile_y_separator|>": 505}
IMAGE_TOKEN = SPECIALS["<|patch|>"]


@pytest.fixture(scope="module")
def llama4_vlm(tmp_path_factory):
    """The model, its tokenizer and template, and its processors' settings as released (Llama 4 Scout's, but
    for the tile's side)."""
    model = tiny_llama4(IMAGE_TOKEN, seed=43, vocab_size=512, eos_token_id=1, pad_token_id=4, bos_token_id=0)
    path = tmp_path_factory.mktemp("llama4-vlm")
    model.save_pretrained(path)
    words = {f"w{i}": 10 + i for i in range(400)} | {"user": 450, "assistant": 451, "system": 452}
    tokenizer = word_level_tokenizer(SPECIALS | words, list(SPECIALS), "<pad>", bos_token="<|begin_of_text|>",
                                     eos_token="<|eot|>", pad_token="<pad>")
    from transformers.models.llama4 import processing_llama4

    tokenizer.chat_template = processing_llama4.chat_template
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor", "max_patches": 16,
        "resize_to_max_canvas": False, "size": {"height": TILE, "width": TILE}, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "rescale_factor": 1 / 255, "resample": 2, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True}))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Llama4Processor", "patch_size": 14,
                                                            "pixel_shuffle_ratio": 0.5}))
    return path, model, tokenizer


@pytest.fixture(scope="module")
def mesh(llama4_vlm):
    """Workers taking at most 2 images a prompt: a tiled image's global tile goes with it, not counted."""
    with image_limited_mesh(llama4_vlm[0], 2) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _transformers_greedy(llama4_vlm, content: list[dict]) -> tuple[list[int], list[torch.Tensor], int]:
    """transformers' greedy tokens for one user message of `content` (image parts holding PIL images), the
    logprobs each was drawn from, and its prompt's length: the template rendered by the tokenizer, each image's
    mark made its tokens by Llama4Processor's own function, its tiles split as its processor splits them."""
    from transformers.image_transforms import split_to_tiles
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    from engine.prompt_images import ImageInput

    _, model, tokenizer = llama4_vlm
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    pieces, pixels, canvas = text.split("<|image|>"), [], TileCanvas(TILE, 16)
    prompt = pieces[0]
    for part, after in zip([p for p in content if p["type"] == "image"], pieces[1:], strict=True):
        whole, global_tile = canvas.tiled(part["image"].convert("RGB"))
        rows, cols = whole.shape[0] // TILE, whole.shape[1] // TILE
        prompt += Llama4Processor._prompt_split_image(None, (rows, cols), TOKENS_PER_TILE) + after
        normalized = [ImageInput(torch.from_numpy(tile.copy()), 1 / 255, (0.5,) * 3, (0.5,) * 3).pixels(True)
                      for tile in (whole, global_tile) if tile is not None]
        pixels += [split_to_tiles(normalized[0][None], rows, cols)[0], *(p[None] for p in normalized[1:])]
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    tokens, logprobs = greedy_logprobs(lambda current: hf_logits(model, current, torch.cat(pixels).float())[0, -1], ids)
    return tokens, logprobs, ids.shape[1]


def test_a_tiled_image_and_a_one_tile_images_greedy_reply_is_transformers(mesh, client, llama4_vlm):
    """A 150x100 image (a 2x3 canvas of 56-pixel tiles and its global tile) and a 40x30 one (one tile): the reply
    transformers'; /tokenize counts the same prompt."""
    wide, small = random_image(1, (150, 100)), random_image(2, (40, 30))
    content = [{"type": "text", "text": "w5 w6"}, {"type": "image_url", "image_url": {"url": data_url(wide)}},
               {"type": "text", "text": "w7"}, {"type": "image_url", "image_url": {"url": data_url(small)}}]
    reply = greedy_chat(client, mesh.model_name, content)
    expected, logprobs, num_prompt = _transformers_greedy(llama4_vlm, [
        {"type": "text", "text": "w5 w6"}, {"type": "image", "image": wide}, {"type": "text", "text": "w7"},
        {"type": "image", "image": small}])
    assert_same_reply(reply, expected, logprobs)
    assert reply.usage.prompt_tokens == num_prompt > (6 + 1 + 1) * TOKENS_PER_TILE
    counted = httpx.post(f"{mesh.gateway.base_url}/tokenize", json={
        "model": mesh.model_name, "messages": [{"role": "user", "content": content}]})
    assert counted.status_code == 200 and counted.json()["count"] == num_prompt
    mesh.assert_decode_pools_free()


def test_a_global_tile_is_not_an_image_of_its_own_under_a_limit(mesh):
    """--limit-mm-per-prompt 1: an image of several tiles goes with its global tile, on the gateway and the
    workers alike; two images are refused."""
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--limit-mm-per-prompt", '{"image": 1}')
    try:
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as limited:
            image = {"type": "image_url", "image_url": {"url": data_url(random_image(3, (200, 60)))}}
            assert len(greedy_chat(limited, mesh.model_name, [image]).choices[0].token_ids) == MAX_TOKENS
            with pytest.raises(openai.BadRequestError, match="limit of 1"):
                greedy_chat(limited, mesh.model_name, [image, image])
    finally:
        assert gateway.terminate() == 0
    mesh.assert_decode_pools_free()
