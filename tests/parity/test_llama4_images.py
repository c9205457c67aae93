"""Llama 4's images against transformers' Llama4ForConditionalGeneration on the same weights: each tile of an
image's canvas through the vision model (2D RoPE with the class token last, pixel shuffle, adapter MLP) and the
projector, whose rows take the places of the image's runs of image tokens, tile after tile."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.vision.image_encoders import image_encoder
from engine.vision.llama4_images import Llama4ImageEncoder
from engine.vision.vision_config import llama4_vision_config
from tests.parity.conftest import transformers

IMAGE_TOKEN = 590
TILE = 56  # 4x4 patches of 14 pixels, shuffled 2x2: 4 rows a tile
TOKENS_PER_TILE = 4
TEXT_HIDDEN = 64


def tiny_llama4(image_token: int, seed: int, **text_options):
    """A tiny Llama4ForConditionalGeneration of random weights: tiles of TILE pixels, 4 rows each."""
    text = transformers.Llama4TextConfig(hidden_size=TEXT_HIDDEN, intermediate_size=64, intermediate_size_mlp=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_local_experts=2, **{"vocab_size": 600, **text_options})
    vision = transformers.Llama4VisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=TILE, patch_size=14,
                                             vision_output_dim=48, projector_input_dim=48, projector_output_dim=48,
                                             pixel_shuffle_ratio=0.5, initializer_range=0.2,
                                             rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=image_token)).eval()
    with torch.no_grad():  # norms, biases and the class token off their init, so each one counts
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "class_embedding" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    model = tiny_llama4(IMAGE_TOKEN, seed=41)
    path = tmp_path_factory.mktemp("llama4-images")
    model.save_pretrained(path)
    return path, model


def _encoder(path) -> Llama4ImageEncoder:
    """Baton's encoder as the model runner builds and loads it, from the saved checkpoint."""
    config = llama4_vision_config(json.loads((path / "config.json").read_text()))
    encoder = image_encoder(config, TEXT_HIDDEN, torch.float32)
    assert isinstance(encoder, Llama4ImageEncoder) and config.tokens_per_image == TOKENS_PER_TILE
    tensors = {name: t for stored, t in load_file(path / "model.safetensors").items()
               if (name := Llama4ImageEncoder.checkpoint_name(stored)) is not None}
    encoder.load_weights(tensors)
    return encoder


def _hf_rows(model, pixels: torch.Tensor) -> torch.Tensor:
    """What transformers puts at the image's tokens: its canvas split into tiles by the image processor's own
    split_to_tiles, through the vision model and projector, flattened over tiles."""
    from transformers.image_transforms import split_to_tiles

    rows, cols = pixels.shape[1] // TILE, pixels.shape[2] // TILE
    tiles = split_to_tiles(pixels[None], rows, cols)[0]
    with torch.no_grad():
        features = model.get_image_features(pixel_values=tiles, return_dict=True).last_hidden_state
        return model.multi_modal_projector(features).flatten(0, 1)


@pytest.mark.parametrize("tiles", [(2, 3), (1, 1)])
def test_image_rows_match_transformers_image_features(llama4, tiles):
    path, model = llama4
    rows, cols = tiles
    pixels = torch.randn(3, rows * TILE, cols * TILE, generator=torch.Generator().manual_seed(rows * cols))
    [ours] = _encoder(path).encode([pixels])
    theirs = _hf_rows(model, pixels)
    assert ours.shape == theirs.shape == (rows * cols * TOKENS_PER_TILE, TEXT_HIDDEN)
    assert theirs.abs().mean() > 0.1  # rows of substance, not a near-zero that any tower would match
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_images_encoded_together_give_each_one_its_rows_and_tiles_keep_their_order(llama4):
    path, _ = llama4
    encoder = _encoder(path)
    g = torch.Generator().manual_seed(7)
    wide, square = torch.randn(3, TILE, 2 * TILE, generator=g), torch.randn(3, TILE, TILE, generator=g)
    together = encoder.encode([wide, square])
    alone = encoder.encode([wide]) + encoder.encode([square])
    for ours, single in zip(together, alone, strict=True):
        torch.testing.assert_close(ours, single, atol=1e-5, rtol=0)
    # The canvas's two tiles swapped: the same rows, their runs swapped.
    [swapped] = encoder.encode([torch.cat([wide[:, :, TILE:], wide[:, :, :TILE]], dim=2)])
    first, second = together[0].split(TOKENS_PER_TILE)
    torch.testing.assert_close(swapped, torch.cat([second, first]), atol=1e-5, rtol=0)
    assert not torch.allclose(first, second, atol=1e-3)


def test_checkpoint_names_as_released_and_under_model_and_not_the_text_models():
    name = Llama4ImageEncoder.checkpoint_name
    assert name("vision_model.model.layers.0.self_attn.q_proj.weight") == \
        "vision_model.model.layers.0.self_attn.q_proj.weight"
    assert name("model.vision_model.class_embedding") == "vision_model.class_embedding"
    assert name("multi_modal_projector.linear_1.weight") == "multi_modal_projector.linear_1.weight"
    assert name("model.multi_modal_projector.linear_1.weight") == "multi_modal_projector.linear_1.weight"
    assert name("language_model.model.layers.0.self_attn.q_proj.weight") is None
    assert name("model.language_model.embed_tokens.weight") is None
    assert name("lm_head.weight") is None


BEGIN, END, MARK, COLUMN_BREAK, ROW_BREAK = 591, 592, 593, 594, 595
MAX_NEW_TOKENS = 6


def _image_tokens(rows: int, cols: int) -> list[int]:
    """An image's tokens as Llama4Processor writes them: a run a tile between separators, then its global tile's
    run after the mark (a one-tile image's one run after it)."""
    run = [IMAGE_TOKEN] * TOKENS_PER_TILE
    tiles = [t for _ in range(rows) for t in [*sum(([*run, COLUMN_BREAK] for _ in range(cols)), [])[:-1], ROW_BREAK]]
    return [BEGIN, *(tiles if rows * cols > 1 else []), MARK, *run, END]


def _canvas(seed: int, rows: int, cols: int):
    """An image as the gateway sends it: its canvas of tiles, and its global tile (a crop beside it) where it
    has more than one; and what transformers' model reads of it (bfloat16, split into tiles)."""
    from transformers.image_transforms import split_to_tiles

    from engine.prompt_images import ImageInput

    g = torch.Generator().manual_seed(seed)
    canvas = torch.randint(0, 256, (rows * TILE, cols * TILE, 3), dtype=torch.uint8, generator=g)
    images = [ImageInput(canvas, 1 / 255, (0.5,) * 3, (0.5,) * 3)]
    if rows * cols > 1:
        images.append(ImageInput(torch.randint(0, 256, (TILE, TILE, 3), dtype=torch.uint8, generator=g), 1 / 255,
                                 (0.5,) * 3, (0.5,) * 3, crop=True))
    pixels = [split_to_tiles(images[0].pixels(in_bfloat16=True)[None], rows, cols)[0],
              *(image.pixels(in_bfloat16=True)[None] for image in images[1:])]
    return images, torch.cat(pixels)


def hf_logits(model, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """Llama4ForConditionalGeneration.forward's steps, by its own parts: transformers 5.24's forward computes them
    and then fails to build its output (it reads an `image_outputs` its text model's output has not)."""
    embeds = model.get_input_embeddings()(ids)
    features = model.get_image_features(pixel_values=pixels, return_dict=True).last_hidden_state
    rows = model.multi_modal_projector(features.flatten(0, 1))
    assert int((ids == model.config.image_token_id).sum()) == len(rows)
    embeds = embeds.masked_scatter((ids == model.config.image_token_id)[..., None], rows)
    return model.language_model(inputs_embeds=embeds).logits


@pytest.mark.parametrize("budget", [512, 16])
def test_greedy_tokens_with_images_match_transformers(llama4, budget):
    """A prompt with a 2x3-tile image (its global tile beside it) and a one-tile image: transformers' greedy tokens
    on the same token ids and pixels (normalized in bfloat16, as Llama4ImageProcessor does), in one step or chunks
    of 16 tokens (a tile's run split across steps)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.parity.conftest import greedy_outputs

    path, model = llama4
    wide, wide_pixels = _canvas(1, 2, 3)
    square, square_pixels = _canvas(2, 1, 1)
    prompt = [1, 7, 8, *_image_tokens(2, 3), 9, 10, *_image_tokens(1, 1), 11, 12, 13]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=budget))
    ours = greedy_outputs(engine, {"r": (prompt, {"images": [*wide, *square]})}, MAX_NEW_TOKENS)["r"]
    pixels = torch.cat([wide_pixels, square_pixels]).float()
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            tokens.append(int(hf_logits(model, torch.tensor([prompt + tokens]), pixels)[0, -1].argmax()))
    assert ours == tokens
