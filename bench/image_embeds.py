"""What an image given as its encoder's rows (vLLM's image_embeds, the gateway's --enable-mm-embeds) spares a
request's time to first token: the gateway reads no pixels, the prefill worker runs no tower.

    .venv/bin/python bench/image_embeds.py [--requests 6] [--width 1344 --height 1008]

A real mesh (1 prefill, 1 decode, a tokenizer and a gateway started with --enable-mm-embeds, each its own
process; the tests' `running_mesh`) serving bench/decode_images.py's tiny Qwen2_5_VLForConditionalGeneration (a
one-block tower over Qwen2.5-VL's 14-pixel patches, its image processor as released), asked by the `openai`
client for one streamed token of a chat with a --width x --height photo (bench/image_cache.py's JPEG, a data:
URL), given either by its URL or as the rows transformers' tower and merger make of it with its
image_grid_thw (made once here, as an encoder elsewhere would). p50 over --requests of each, alternating, each
chat opening with a word of its own so that no prompt finds another's pages in a prefix cache.
ttft_image_url_vs_embeds is the URL's p50 / the rows'.

The last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch
import transformers
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.decode_images import GATEWAY_ARGS, save_tiny_qwen_vl  # noqa: E402
from bench.image_cache import photo_url  # noqa: E402
from bench.local_mesh import log  # noqa: E402
from bench.mesh_overhead import SETTLE_S, p50_ms  # noqa: E402
from tests.services.gateway import mesh as test_mesh  # noqa: E402


def saved(tensor: torch.Tensor) -> str:
    data = io.BytesIO()
    torch.save(tensor, data)
    return base64.b64encode(data.getvalue()).decode()


def image_embeds_part(model_dir: Path, url: str) -> dict:
    """The photo as an image_embeds part: transformers' tower and merger's rows for it, and its grid."""
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    image = Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2])))
    inputs = processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        rows = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                              image_grid_thw=inputs["image_grid_thw"]).pooler_output[0]
    return {"type": "image_embeds", "image_embeds": {"image_embeds": saved(rows),
                                                     "image_grid_thw": saved(inputs["image_grid_thw"])}}


def first_token_s(client: openai.OpenAI, model: str, word: str, image_part: dict) -> tuple[float, int]:
    """Seconds to the first streamed token of a chat of `word` and the image, and its prompt's tokens."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": word}, image_part]}],
        max_tokens=1, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    first, prompt_tokens = None, 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return first, prompt_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=1008)
    args = parser.parse_args(argv)
    url = photo_url(args.width, args.height)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen2_5_vl"
        save_tiny_qwen_vl(model_dir)
        by_url = {"type": "image_url", "image_url": {"url": url}}
        by_rows = image_embeds_part(model_dir, url)
        log(f"{args.width}x{args.height} photo: {len(url) / 2**20:.2f} MiB as a data: URL, "
            f"{len(by_rows['image_embeds']['image_embeds']) / 2**20:.2f} MiB as rows")
        with test_mesh.running_mesh(model_dir, num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"),
                                    gateway_args=(*GATEWAY_ARGS, "--enable-mm-embeds")) as mesh, \
                openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            samples: dict[str, list[float]] = {"url": [], "embeds": []}
            tokens: dict[str, int] = {}
            parts = {"url": by_url, "embeds": by_rows}
            for word, name in zip(("w478", "w479"), parts, strict=True):  # one of each warms its path
                first_token_s(client, mesh.model_name, word, parts[name])
            for i in range(args.requests):
                for name in (["url", "embeds"] if i % 2 == 0 else ["embeds", "url"]):
                    time.sleep(SETTLE_S)  # OpenMP threads spin a while after a parallel region
                    seconds, tokens[name] = first_token_s(client, mesh.model_name,
                                                          f"w{2 * i + (name == 'embeds')}", parts[name])
                    samples[name].append(seconds)
    url_ms, embeds_ms = p50_ms(samples["url"]), p50_ms(samples["embeds"])
    log(f"Time to first token, p50 of {args.requests}, {tokens['url']} prompt tokens: the photo by its URL "
        f"{url_ms:.1f} ms, as its encoder's rows {embeds_ms:.1f} ms: {url_ms / embeds_ms:.2f}x")
    print(json.dumps({"ttft_image_url_ms": round(url_ms, 2), "ttft_image_embeds_ms": round(embeds_ms, 2),
                      "ttft_image_url_vs_embeds": round(url_ms / embeds_ms, 2), "prompt_tokens": tokens["url"],
                      "requests": args.requests, "width": args.width, "height": args.height}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
