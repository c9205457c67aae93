"""What the gateway's processed-image cache (vLLM's --mm-processor-cache-gb) saves a conversation's next turn:
reading a chat's photo as the model's image processor makes it, from a data: URL, with the cache holding it
against without a cache, alternating round by round in this process.

    .venv/bin/python bench/image_cache.py [--rounds 20] [--width 3000 --height 2000]

The photo is a JPEG of smooth gradients and noise (quality 90); the processors are Gemma 3's (896x896,
bilinear) and Mistral 3's (Pixtral's: at most 1540 pixels a side in whole 28-pixel tokens, bicubic), with the
settings their released preprocessor_config.json files give. Uncached, a read decodes, resizes and hashes the
pixels (ChatImages.read, on its thread); cached, it hashes the encoded bytes and finds the image. p50 of each,
and their ratio (`*_speedup`). The last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from services.gateway.image_cache import ProcessedImageCache  # noqa: E402
from services.gateway.image_inputs import ChatImages  # noqa: E402
from services.gateway.image_processing import ImageProcessing  # noqa: E402

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PROCESSORS = {
    "gemma3": ({"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
                "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "rescale_factor": 1 / 255}, None),
    "mistral3": ({"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": 1540}, "resample": 3,
                  "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "rescale_factor": 1 / 255},
                 {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2}),
}


def photo_url(width: int, height: int) -> str:
    """A data: URL of a photo-like JPEG: gradients over the frame, and noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(0)
    channels = [np.sin(x / (97 + 31 * c)) * np.cos(y / (61 + 17 * c)) for c in range(3)]
    pixels = (np.stack(channels, axis=-1) * 100 + 128 + rng.normal(0, 12, (height, width, 3))).clip(0, 255)
    saved = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(saved, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(saved.getvalue()).decode()


async def timed_read(images: ChatImages, url: str) -> float:
    start = time.perf_counter()
    await images.read([url])
    return time.perf_counter() - start


async def bench(processing: ImageProcessing, url: str, rounds: int) -> tuple[float, float]:
    uncached = ChatImages(processing)
    cached = ChatImages(processing, cache=ProcessedImageCache(2**30))
    await cached.read([url])  # the first turn's read: the next ones find it
    samples: dict[str, list[float]] = {"uncached": [], "cached": []}
    for i in range(rounds):
        order = [("uncached", uncached), ("cached", cached)]
        for name, images in order if i % 2 == 0 else order[::-1]:
            samples[name].append(await timed_read(images, url))
    return statistics.median(samples["uncached"]) * 1e3, statistics.median(samples["cached"]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--width", type=int, default=3000)
    parser.add_argument("--height", type=int, default=2000)
    args = parser.parse_args()
    url = photo_url(args.width, args.height)
    print(f"photo: {args.width}x{args.height} JPEG, {len(url) * 3 // 4 / 2**20:.2f} MiB")
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (preprocessor, processor) in PROCESSORS.items():
            model_dir = Path(tmp) / name
            model_dir.mkdir()
            (model_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
            if processor is not None:
                (model_dir / "processor_config.json").write_text(json.dumps(processor))
            processing = ImageProcessing.from_dir(model_dir)
            uncached_ms, cached_ms = asyncio.run(bench(processing, url, args.rounds))
            height, width = processing.size_of(args.height, args.width)
            print(f"{name}: resized to {width}x{height}; read uncached p50 {uncached_ms:.2f} ms, cached "
                  f"{cached_ms:.2f} ms: {uncached_ms / cached_ms:.1f}x")
            figures.update({f"{name}_read_uncached_ms": round(uncached_ms, 3),
                            f"{name}_read_cached_ms": round(cached_ms, 3),
                            f"{name}_speedup": round(uncached_ms / cached_ms, 2)})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
