"""Step-3.7's images against transformers' Step3p7ForConditionalGeneration on the same weights: each square view of an
image (its local crops, then its global view, each an image of its own here) through the tower (learnt positions
resampled to the view, 2D RoPE over q's and k's halves once their released pairs are reordered, layer scales, two
strided convolutions) and the projector, whose rows take the places of the views' runs of image tokens."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.vision.image_encoders import image_encoder
from engine.vision.step3p7_images import Step3p7ImageEncoder
from engine.vision.vision_config import step3p7_vision_config
from tests.parity.conftest import greedy_outputs, transformers
from tests.parity.test_step3p7 import TEXT

IMAGE_TOKEN, PATCH_START, PATCH_END, PATCH_NEWLINE, IMAGE_START, IMAGE_END = 500, 501, 502, 503, 504, 505
GLOBAL, LOCAL = 112, 56  # a view's side: 8x8 patches of 14 pixels, downsampled to 2x2 rows; 4x4 to one
MAX_NEW_TOKENS = 6


def tiny_step3p7(seed: int, **text_changes):
    """A tiny Step3p7ForConditionalGeneration of random weights, its tower's included (each norm, bias and layer
    scale off its init, so each one counts): views of GLOBAL pixels at its learnt positions' size."""
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=GLOBAL, patch_size=14,
                  mlp_ratio=2.0)
    config = transformers.Step3p7Config(text_config={**TEXT, **text_changes}, vision_config=vision,
                                        image_token_id=IMAGE_TOKEN, projector_bias=True)
    torch.manual_seed(seed)
    model = transformers.Step3p7ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "lambda" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def step3p7(tmp_path_factory):
    model = tiny_step3p7(61)
    path = tmp_path_factory.mktemp("step3p7-images")
    model.save_pretrained(path)
    return path, model


def _encoder(path) -> Step3p7ImageEncoder:
    """Baton's encoder as the model runner builds and loads it, from the saved checkpoint."""
    config = step3p7_vision_config(json.loads((path / "config.json").read_text()))
    encoder = image_encoder(config, TEXT["hidden_size"], torch.float32)
    tensors = {name: t for stored, t in load_file(path / "model.safetensors").items()
               if (name := Step3p7ImageEncoder.checkpoint_name(stored)) is not None}
    encoder.load_weights(tensors)
    return encoder


def _hf_rows(model, views: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.model.multi_modal_projector(model.model.vision_model(views).last_hidden_state)


def test_views_rows_match_transformers_tower_and_projector(step3p7):
    """The global view at the learnt positions' own size, a local one below it and a view above it (its positions
    resampled down and up), encoded together."""
    path, model = step3p7
    g = torch.Generator().manual_seed(3)
    views = [torch.randn(3, side, side, generator=g) for side in (GLOBAL, LOCAL, LOCAL, 168)]
    ours = _encoder(path).encode(views)
    for view, rows in zip(views, ours, strict=True):
        theirs = _hf_rows(model, view[None])[0]
        assert rows.shape == theirs.shape == ((view.shape[1] // 56) ** 2, TEXT["hidden_size"])
        assert theirs.abs().mean() > 0.1  # rows of substance, not a near-zero any tower would match
        torch.testing.assert_close(rows, theirs, atol=1e-5, rtol=2e-5)  # (rows of some units)


def _image_tokens(columns: int, rows: int) -> list[int]:
    """An image's tokens as Step3p7Processor writes them: a run between patch marks a local crop, row by row, each row
    but the last ended by a newline, then its global view's run between image marks."""
    local = [PATCH_START, *[IMAGE_TOKEN] * (LOCAL // 56) ** 2, PATCH_END]
    crops = [t for row in range(rows) for col in range(columns)
             for t in [*local, *([PATCH_NEWLINE] if col == columns - 1 and row < rows - 1 else [])]]
    return [*crops, IMAGE_START, *[IMAGE_TOKEN] * (GLOBAL // 56) ** 2, IMAGE_END]


@pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)
@pytest.mark.parametrize("budget, size", [(512, 1), (16, 1), (16, 2)])
def test_greedy_tokens_with_images_match_transformers(step3p7, budget, size):
    """A prompt with an image of 2x2 local crops beside its global view and one of its global view alone:
    transformers' greedy tokens (its generate given the pixels) on the same token ids and pixels, in one step or in
    chunks of 16 tokens (the second image's run split across steps), and split across two ranks (rank 0 encoding
    the images)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.prompt_images import ImageInput

    path, model = step3p7
    g = torch.Generator().manual_seed(5)

    def view(side: int, crop: bool) -> ImageInput:
        return ImageInput(torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=g), 1 / 255,
                          (0.48, 0.46, 0.41), (0.27, 0.26, 0.28), crop=crop)

    crops = [view(LOCAL, crop=i > 0) for i in range(4)]
    first, second = view(GLOBAL, crop=True), view(GLOBAL, crop=False)
    prompt = [1, 7, 8, 20, 21, 22, 23, 24, 25, *_image_tokens(2, 2), 9, 10, *_image_tokens(0, 0), 11, 12, 13]
    assert prompt[31:35] == [IMAGE_TOKEN] * 4  # (its second image's run across the chunks' boundary at 32)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=budget, tensor_parallel_size=size))
    ours = greedy_outputs(engine, {"r": (prompt, {"images": [*crops, first, second]})}, MAX_NEW_TOKENS)["r"]
    engine.close()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             pixel_values=torch.stack([first.pixels(), second.pixels()]),
                             pixel_values_local=torch.stack([crop.pixels() for crop in crops]),
                             num_local_patches=[4, 0], pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()
