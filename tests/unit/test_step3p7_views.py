"""Step-3.7's image processing as transformers' Step3p7ImageProcessor and Step3p7Processor do it: how an image is cut
(transformers' own planning function), its crops row by row, the prompt's marks of its views (transformers' own
function), and, where torchvision imports, the pixels themselves."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
from PIL import Image

from services.gateway.image_processing import ImageProcessing
from services.gateway.step3p7_views import LocalCrops
from services.tokenizer.image_tokens import STEP3P7_MARKS, ImageSize, read_image_tokens

transformers = pytest.importorskip("transformers")
from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor  # noqa: E402
from transformers.models.step3p7.processing_step3p7 import Step3p7Processor  # noqa: E402

SIZES = [(1000, 700), (728, 728), (700, 1000), (400, 300), (300, 700), (20, 400), (3000, 500), (5000, 4000),
         (504, 504), (1100, 540), (30, 2000), (1, 1), (729, 200), (6000, 100)]


@pytest.mark.parametrize("width, height", SIZES)
def test_an_image_is_planned_as_transformers_plans_it(width, height):
    processor = types.SimpleNamespace(max_image_size=3024, _is_extreme_aspect=Step3p7ImageProcessor._is_extreme_aspect)
    theirs = Step3p7ImageProcessor._plan_patches(processor, width, height, 728, 504)
    plan = LocalCrops().plan(height, width)
    assert ((plan.width, plan.height), (plan.crop_width, plan.crop_height), plan.window, plan.columns, plan.rows,
            plan.square_padded) == theirs


def test_crops_are_the_windows_row_by_row_and_the_global_view_the_whole_squeezed():
    """An image of 3x2 windows of 504 pixels, each a colour of its own: its six crops are those colours in turn;
    a small one has none."""
    colours = np.arange(6 * 3, dtype=np.uint8).reshape(2, 3, 3) * 13
    image = Image.fromarray(np.repeat(np.repeat(colours, 504, axis=0), 504, axis=1))
    crops, whole, columns = LocalCrops().views(image)
    assert columns == 3 and [crop.shape for crop in crops] == [(504, 504, 3)] * 6 and whole.shape == (728, 728, 3)
    assert [tuple(crop[250, 250]) for crop in crops] == [tuple(c) for c in colours.reshape(6, 3)]
    assert (crops[4] == colours[1, 1]).all()
    assert LocalCrops().views(Image.new("RGB", (300, 280)))[::2] == ([], 0)


def test_where_torchvision_imports_the_pixels_are_transformers():
    pytest.importorskip("torchvision")
    import torch

    rng = np.random.default_rng(5)
    processor = Step3p7ImageProcessor()
    for width, height in ((1000, 700), (300, 700), (20, 400), (728, 728)):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        theirs = processor(images=[image], return_tensors="pt")
        crops, whole, _ = LocalCrops().views(image)
        mean, std = torch.tensor(processor.image_mean)[:, None, None], torch.tensor(processor.image_std)[:, None, None]

        def normalized(rgb):
            return (torch.from_numpy(rgb).permute(2, 0, 1).double() / 255).float().sub(mean).div(std)

        torch.testing.assert_close(normalized(whole), theirs["pixel_values"][0], atol=1e-5, rtol=0)
        assert len(crops) == theirs["num_local_patches"][0]
        for i, crop in enumerate(crops):
            torch.testing.assert_close(normalized(crop), theirs["pixel_values_local"][i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("crops, columns", [(0, 0), (1, 1), (4, 2), (6, 3), (3, 1), (2, 2)])
def test_an_images_tokens_are_step3p7_processors(crops, columns):
    """Its crops' runs between patch marks, a newline after each row but the last, then its global view's run."""
    tokens = read_image_tokens({}, {"image_processor": {"size": {"height": 112, "width": 112}, "patch_size": 56}},
                               {"model_type": "step3p7"})
    mark = STEP3P7_MARKS[0]
    processor = types.SimpleNamespace(patch_feature_placeholder=mark, image_feature_placeholder=mark * 4)
    masks = [[col == columns - 1 and row < crops // columns - 1 for row in range(crops // max(columns, 1))
              for col in range(columns)]]
    theirs = Step3p7Processor.replace_image_token(processor, {"num_local_patches": [crops],
                                                              "patch_newline_masks": masks}, 0)
    size = ImageSize(56, 56, crops, columns=columns) if crops else ImageSize(112, 112)
    assert tokens.expanded(f"a{mark}b", [size], 1) == f"a{theirs}b"


def test_the_image_processors_settings_are_read_and_only_max_image_size_changed(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Step3p7ImageProcessor", "size": {"height": 112, "width": 112}, "patch_size": 56,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]}))
    processing = ImageProcessing.from_dir(tmp_path)
    assert processing.local_crops == LocalCrops(112, 56, 3024) and processing.mean == (0.5,) * 3
    assert processing.with_kwargs({"max_image_size": 500}).local_crops.max_image_size == 500
    with pytest.raises(ValueError, match="takes no patch_size"):
        processing.with_kwargs({"patch_size": 100})
    image = processing.processed(Image.new("RGB", (112, 56)))  # 2x1 crops (56 on a side) and the global view
    assert (image.meta.height, image.columns, len(image.crops)) == (56, 2, 2)
    assert [crop.meta.crop for crop in image.crops] == [True, True] and image.crops[-1].meta.height == 112
