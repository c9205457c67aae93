"""Gemma 4's images against transformers' Gemma4ForConditionalGeneration on the same weights: the tower's rows (patches
of any number, 2D RoPE and positions, squares averaged, standardized, projected; its linear layers clamped or not) in
place of each image's tokens, which attend to each other both ways in the sliding-window layers only
(mm_token_type_ids' blocks), the padding token's per-layer embeddings at their places; logits and greedy tokens, in
one chunk or many, beside a text prompt."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prompt_images import ImageInput
from tests.parity.conftest import greedy_outputs, transformers
from tests.parity.images import assert_logprobs_match

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE = 500, 498, 499
PATCH, POOL = 4, 2  # a token a square of 2x2 patches of 4x4 pixels
MAX_NEW_TOKENS = 8
SIZES = ((16, 24), (24, 8))  # (height, width): 6 and 3 tokens


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "clipped-linears"])
def gemma4_with_images(request, tmp_path_factory):
    text = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, vocab_size=512, vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 3,
        final_logit_softcapping=30.0, use_bidirectional_attention="vision", initializer_range=0.2, pad_token_id=0)
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, patch_size=PATCH, pooling_kernel_size=POOL, position_embedding_size=16, standardize=True,
        use_clipped_linears=request.param)
    torch.manual_seed(41)
    model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None, image_token_id=IMAGE_TOKEN,
        boi_token_id=BEGIN_IMAGE, eoi_token_id=END_IMAGE)).eval()
    with torch.no_grad():  # norms, scalars and the standardization off their init, so each one counts
        for name, p in model.named_parameters():
            if "norm" in name or "projection" in name or "position_embedding" in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith(("layer_scalar", "std_scale")):
                b.add_(torch.randn_like(b) * 0.2)
            elif name.endswith("std_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
            elif name.endswith(("_min", "_max")):  # bounds that clamp (its inputs' and outputs' spread is about 1)
                b.fill_((-1.0 if name.endswith("_min") else 1.0) * (0.5 + torch.rand(()).item()))
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("gemma4-images")
    model.save_pretrained(path)
    return path, model


def _images(seed: int) -> list[ImageInput]:
    """Random images as Gemma 4's processor resized them (rescaled to [0, 1], not normalized)."""
    g = torch.Generator().manual_seed(seed)
    return [ImageInput(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g), 1 / 255, (0.0,) * 3,
                       (1.0,) * 3) for h, w in SIZES]


def _tokens(image: ImageInput) -> int:
    return (image.shape[0] // PATCH // POOL) * (image.shape[1] // PATCH // POOL)


def _prompt(seed: int, images: list[ImageInput]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, 490, (n,), generator=g).tolist()  # noqa: E731
    prompt = [2, *text(5)]
    for i, image in enumerate(images):
        prompt += [BEGIN_IMAGE, *[IMAGE_TOKEN] * _tokens(image), END_IMAGE, *text(7 + i)]
    return prompt


def _patches(images: list[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """What Gemma 4's processor gives transformers' model: each image's patches row by row (a patch's pixels row by
    row, channel by channel) and their (column, row) positions, padded to the longest with positions of -1."""
    patches, positions = [], []
    for image in images:
        pixels = image.pixels()  # [C, H, W]
        rows, cols = pixels.shape[1] // PATCH, pixels.shape[2] // PATCH
        patches.append(pixels.reshape(3, rows, PATCH, cols, PATCH).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1))
        row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions.append(torch.stack((col.flatten(), row.flatten()), dim=-1))
    longest = max(p.shape[0] for p in patches)
    return (torch.stack([torch.nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in patches]),
            torch.stack([torch.nn.functional.pad(p, (0, 0, 0, longest - p.shape[0]), value=-1) for p in positions]))


def _hf_logits(model, ids: list[int], images: list[ImageInput]) -> torch.Tensor:
    pixels, positions = _patches(images) if images else (None, None)
    current = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=current, pixel_values=pixels, image_position_ids=positions,
                     mm_token_type_ids=(current == IMAGE_TOKEN).long()).logits[0]


def _hf_greedy(model, prompt: list[int], images: list[ImageInput]) -> list[int]:
    tokens: list[int] = []
    for _ in range(MAX_NEW_TOKENS):
        tokens.append(int(_hf_logits(model, prompt + tokens, images)[-1].argmax()))
    return tokens


def _engine(path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(path), "dtype": "float32", "num_kv_blocks": 64,
                                     "max_num_batched_tokens": 512, **options}))


# 16: chunks ending inside a run are cut back to before it; size 2: the text model split across two ranks (the image
# encoder rank 0's, whole)
@pytest.mark.parametrize(("budget", "size"), [(512, 1), (16, 1), (16, 2)])
def test_greedy_tokens_with_images_are_transformers(gemma4_with_images, budget, size):
    path, model = gemma4_with_images
    images = _images(1)
    prompt = _prompt(2, images)
    token_prompt = _prompt(3, [])
    engine = _engine(path, max_num_batched_tokens=budget, tensor_parallel_size=size)
    results = greedy_outputs(engine, {"images": (prompt, {"images": images}), "text": (token_prompt, {})},
                             MAX_NEW_TOKENS)
    engine.close()
    assert results["images"] == _hf_greedy(model, prompt, images)
    assert results["text"] == _hf_greedy(model, token_prompt, [])


@pytest.mark.parametrize("budget", [512, 16])
def test_logprobs_with_images_are_transformers(gemma4_with_images, budget):
    """Logprobs, not only tokens: an image's tokens attended causally, or both ways in the full layers too, would
    still give these greedy tokens here, but not these numbers."""
    path, model = gemma4_with_images
    images = _images(4)
    prompt = _prompt(5, images)
    engine = _engine(path, max_num_batched_tokens=budget)
    assert_logprobs_match(engine, prompt, images, lambda ids: _hf_logits(model, ids, images)[-1])
    engine.close()
