"""Llama 4's image processing as transformers' Llama4ImageProcessor does it: the canvas of tiles an image goes
into (transformers' own functions), and, where torchvision imports, the pixels themselves."""
from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from services.gateway.errors import APIError
from services.gateway.image_processing import ImageProcessing
from services.gateway.llama4_tiles import TileCanvas

transformers = pytest.importorskip("transformers")

SIZES = [(900, 500), (336, 336), (100, 80), (2000, 300), (300, 2000), (1000, 1000), (337, 335), (5000, 4000),
         (640, 480), (50, 3000), (1344, 1344), (700, 340), (1, 1), (336, 5000)]


@pytest.fixture
def reference(monkeypatch):
    """transformers' image_processing_llama4 module: imported as it is where torchvision imports; else with an
    empty stand-in for torchvision's functional module, which its canvas functions never call."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):  # none here, or one built for another torch
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "torchvision.transforms.v2.functional",
                            types.ModuleType("torchvision.transforms.v2.functional"))
        sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
        monkeypatch.delitem(sys.modules, "transformers.models.llama4.image_processing_llama4", raising=False)
        module = importlib.import_module("transformers.models.llama4.image_processing_llama4")
        monkeypatch.delitem(sys.modules, "transformers.models.llama4.image_processing_llama4")
        return module
    return importlib.import_module("transformers.models.llama4.image_processing_llama4")


@pytest.mark.parametrize(("max_tiles", "to_max_canvas"), [(16, False), (5, False), (16, True)])
def test_the_canvas_and_size_are_transformers(reference, max_tiles, to_max_canvas):
    """The canvases in transformers' order (its ties broken alike), the best fit of each size, and the size
    the image is resized to in it (never upscaled past one tile's side unless to the largest canvas)."""
    ours = TileCanvas(336, max_tiles, to_max_canvas)
    tile = transformers.image_utils.SizeDict(height=336, width=336)
    reference.find_supported_resolutions.cache_clear()
    canvases = reference.find_supported_resolutions(max_num_chunks=max_tiles, patch_size=tile)
    assert ours.canvases == [tuple(canvas) for canvas in canvases]
    for height, width in SIZES:
        canvas = reference.get_best_fit((height, width), torch.tensor(canvases),
                                        resize_to_max_canvas=to_max_canvas).tolist()
        assert ours.canvas_of(height, width) == tuple(canvas), (height, width)
        bound = canvas if to_max_canvas else (min(max(height, 336), canvas[0]), min(max(width, 336), canvas[1]))
        expected = reference.get_max_res_without_distortion((height, width), bound)
        assert ours.resized_size(height, width, tuple(canvas)) == (max(expected[0], 1), max(expected[1], 1))


def test_pixels_equal_llama4s_image_processor(tmp_path):
    """Each tile's pixels, and the global tile's, bit for bit as the processor makes them (bfloat16, normalized
    so), the canvas split row by row. Needs torchvision, which transformers' processor resizes with."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"transformers' Llama4ImageProcessor needs torchvision: {e}")
    from transformers.image_transforms import split_to_tiles

    from engine.prompt_images import ImageInput

    reference = transformers.Llama4ImageProcessor(max_patches=16)
    reference.save_pretrained(tmp_path)
    ours = ImageProcessing.from_dir(tmp_path)
    for width, height in SIZES:
        image = Image.fromarray((np.random.default_rng(width + height).random((height, width, 3)) * 255)
                                .astype(np.uint8))
        expected = reference(images=image, return_tensors="pt")
        processed = ours.processed(image)
        rows, cols = expected["aspect_ratios"][0].tolist()
        assert (processed.meta.height, processed.meta.width, len(processed.crops)) == \
            (rows * 336, cols * 336, int(rows * cols > 1))
        pixels = [ImageInput(torch.frombuffer(bytearray(part.rgb), dtype=torch.uint8).view(
            part.meta.height, part.meta.width, 3), part.meta.rescale_factor, tuple(part.meta.mean),
            tuple(part.meta.std)).pixels(in_bfloat16=True) for part in processed.with_crops]
        tiles = [split_to_tiles(pixels[0][None], rows, cols)[0], *(p[None] for p in pixels[1:])]
        assert torch.equal(torch.cat(tiles), expected["pixel_values"]), (width, height)


def test_max_patches_and_resize_to_max_canvas_as_a_requests_kwargs(tmp_path):
    """Llama4ImageProcessor's own settings over preprocessor_config.json's, as vLLM passes a request's
    mm_processor_kwargs to it: fewer tiles, or the largest canvas; another processor takes neither."""
    (tmp_path / "preprocessor_config.json").write_text(
        '{"image_processor_type": "Llama4ImageProcessorFast", "max_patches": 16, "size": {"height": 336, '
        '"width": 336}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}')
    processing = ImageProcessing.from_dir(tmp_path)
    assert processing.tiles.canvas_of(2000, 1500) == (4 * 336, 3 * 336)
    fewer = processing.with_kwargs({"max_patches": 4})
    assert fewer.tiles.canvas_of(2000, 1500) == TileCanvas(336, 4).canvas_of(2000, 1500) == (2 * 336, 2 * 336)
    largest = processing.with_kwargs({"resize_to_max_canvas": True})
    assert largest.tiles.canvas_of(100, 100) == (4 * 336, 4 * 336) != processing.tiles.canvas_of(100, 100)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(tmp_path / "qwen")
    with pytest.raises(ValueError, match="takes no max_patches"):
        ImageProcessing.from_dir(tmp_path / "qwen", {"max_patches": 4})
    with pytest.raises(ValueError, match="max_patches must be at most 256"):
        processing.with_kwargs({"max_patches": 10**6})
    # A canvas past a worker message's bytes: refused from the image's size, before its pixels are made.
    many = processing.with_kwargs({"max_patches": 256, "resize_to_max_canvas": True})
    with pytest.raises(APIError, match="canvas of 16x16 tiles takes 83.0 MiB") as refused:
        many.processed(Image.new("RGB", (40, 40)), most_bytes=64 * 2**20)
    assert refused.value.status == 413
