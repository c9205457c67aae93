"""What a decode worker is spared now that the gateway sends it a request's images without their pixels
(e569391: their sizes and digests only, as the gateway's params carry them since given_embeddings.py's `given_to`
put no pixels there; the pages hold their KV).

    .venv/bin/python bench/decode_images.py [--rounds 30] [--width 3000 --height 2000]
        [--requests 10] [--mesh-width 1344 --mesh-height 1008] [--no-mesh]

The image processor is Qwen2.5-VL's (Qwen2-VL's smart resize, 28-pixel tokens: 14-pixel patches merged 2x2,
its default max_pixels 12845056), saved by transformers with a tiny Qwen2_5_VLForConditionalGeneration; the
photo is bench/image_cache.py's JPEG.

- In this process: a --width x --height photo, read as the gateway reads it, in the DecodeRequest the gateway
  builds (step_sources.py's) with its pixels (as before e569391; request_bytes.py's `with_inputs` splicing them
  in) and without: its serialized bytes, the time to build and serialize it, the worker's time to parse it and
  to read its images (`given_inputs`: with pixels, a copy of them into a tensor), p50 over --rounds rounds, the
  two alternating. `*_saved` figures are with pixels / without (decode_request_bytes_saved: bytes with / without).
- Through a real mesh (1 prefill, 1 decode, a tokenizer and the gateway, each its own process; the tests'
  `running_mesh`), by the gateway's gRPC API: the time from the first streamed token (prefill's) to the second
  (the decode worker's first: the KV handoff, the Decode call and its first step) of a chat with a
  --mesh-width x --mesh-height photo, against a text chat of as many prompt tokens, p50 over --requests each,
  the three kinds alternating. The image chat goes both through the mesh's gateway and through a second
  gateway over the same workers that gives the decode worker every pixel (the pixels put in the params again,
  as the gateway before e569391 put them). image_gap_vs_text and image_gap_with_pixels_vs_text are each image
  chat's p50 gap / the text chat's, image_gap_saved the one with pixels / the one without. The photo is smaller
  here so that prefill stays quick on a CPU: its pixels are MBs, its tokens under 2,000 (the tiny model's
  context is 2,048); and the tiny tower is one block, of full attention: its attention over the photo's ~7,000
  patches took 3.4 s a chat with the tests' four blocks, 1 s with one (the gap after the first token does not
  depend on it). Each chat opens with a word of its own, so no prompt finds another's pages in a prefix cache.

The last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from unittest import mock

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.image_cache import CLIP_MEAN, CLIP_STD, photo_url  # noqa: E402
from bench.local_mesh import log  # noqa: E402
from bench.mesh_overhead import SETTLE_S, client_channel, p50_ms  # noqa: E402
from protos import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from services.common.prompt_embeds import given_inputs  # noqa: E402
from services.gateway.given_embeddings import GivenImages  # noqa: E402
from services.gateway.image_inputs import ChatImages  # noqa: E402
from services.gateway.image_processing import ImageProcessing  # noqa: E402
from services.gateway.request_bytes import BulkInputs, with_inputs  # noqa: E402
from tests.parity.images import QWEN2_5_VL_TEXT, QWEN2_5_VL_VISION  # noqa: E402
from tests.services.gateway import mesh as test_mesh  # noqa: E402
from tests.services.gateway.test_qwen_vl_chat_images import (  # noqa: E402
    IMAGE,
    MARKS,
    TEMPLATE,
    VISION_END,
    VISION_START,
    _tokenizer as tiny_tokenizer,  # the tests' word-level tokenizer, with Qwen-VL's image marks
)
from tests.services.preloaded_python import spawn  # noqa: E402

QWEN2_5_VL_MAX_PIXELS = 12845056  # its preprocessor_config.json's: 38 MB of RGB at the most
# Real Qwen2.5-VL's patch and window (in pixels) on the tiny tower, 28 pixels a token; one block (see above).
VISION = dict(QWEN2_5_VL_VISION, patch_size=14, window_size=112, depth=1, fullatt_block_indexes=[0])
# Every chat to a prefill worker, then to the decode worker (no gateway renders a chat or prefills one itself).
GATEWAY_ARGS = ("--local-prefill-max-tokens", "0", "--local-tokenize-max-chars", "0")
# The gateway before e569391, as the mesh's gateway would run: its params carry the images' pixels, and so
# does every request it makes of them, each Decode call's too.
WITH_PIXELS_GATEWAY = """
import sys
from services.gateway import given_embeddings, step_sources
def given_to(self, params):
    params.images.extend(image.proto() for image in self.images)
    params.cache_salt = given_embeddings.salted_with_embeddings(
        params.cache_salt if params.HasField("cache_salt") else None, self.digest)
given_embeddings.GivenImages.given_to = given_to
step_sources.with_inputs = lambda request, bulk: request
from services.gateway.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def save_tiny_qwen_vl(path: Path) -> None:
    """A Qwen2_5_VLForConditionalGeneration of random weights, the tests' tokenizer and chat template, and Qwen2.5-VL's
    image processor, as transformers saves them."""
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen2_5_VLConfig(text_config=QWEN2_5_VL_TEXT, vision_config=VISION,
                                           image_token_id=MARKS[IMAGE], vision_start_token_id=MARKS[VISION_START],
                                           vision_end_token_id=MARKS[VISION_END])
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                                          max_pixels=QWEN2_5_VL_MAX_PIXELS, image_mean=CLIP_MEAN,
                                          image_std=CLIP_STD).save_pretrained(path)


def p50s_alternating(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """p50 milliseconds of each of `fns`, run in turn round by round (each round starting one later), so
    that each sees the same machine."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds + 1):  # the first round warms up
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            fns[name]()
            if i:
                samples[name].append(time.perf_counter() - start)
    return {name: p50_ms(values) for name, values in samples.items()}


def decode_request(prompt: list[int], sampling: common_pb2.SamplingParams, images: GivenImages | None = None
                   ) -> bytes:
    """The DecodeRequest the gateway sends after a handoff (step_sources.py's), serialized as gRPC sends it;
    with `images`, their pixels in it too (with_inputs, as the gateway before e569391 sent them)."""
    request = decode_pb2.DecodeRequest(request_id="bench", reservation_id="bench", prompt_token_ids=prompt,
                                       first_token_id=10, sampling=sampling)
    made = with_inputs(request, BulkInputs(images=images) if images is not None else None)
    return made if isinstance(made, bytes) else made.SerializeToString()


def bench_request(model_dir: Path, args) -> dict:
    """Bytes and times of the DecodeRequest of a chat with the --width x --height photo, with its pixels and
    without, at the gateway and at the decode worker."""
    processing = ImageProcessing.from_dir(model_dir)
    images: GivenImages = asyncio.run(ChatImages(processing).read([photo_url(args.width, args.height)]))
    params = common_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    images.given_to(params)
    (height, width), = images.sizes
    num_image_tokens = height * width // processing.pixels_per_token ** 2
    prompt = [MARKS[VISION_START], *[MARKS[IMAGE]] * num_image_tokens, MARKS[VISION_END], 10, 11]
    sent = {"with_pixels": decode_request(prompt, params, images), "withheld": decode_request(prompt, params)}
    log(f"photo {args.width}x{args.height} resized to {width}x{height}: {num_image_tokens} tokens, "
        f"{images.num_bytes / 2**20:.1f} MiB of pixels")
    build_ms = p50s_alternating({"with_pixels": lambda: decode_request(prompt, params, images),
                                 "withheld": lambda: decode_request(prompt, params)}, args.rounds)
    parse_ms = p50s_alternating({name: lambda b=body: decode_pb2.DecodeRequest.FromString(b)
                                 for name, body in sent.items()}, args.rounds)
    parsed = {name: decode_pb2.DecodeRequest.FromString(body) for name, body in sent.items()}
    # One loop for every read, as a worker has: a loop made per read would be timed as well.
    with closing(asyncio.new_event_loop()) as loop:
        read_ms = p50s_alternating({name: lambda r=request: loop.run_until_complete(given_inputs(r.sampling))
                                    for name, request in parsed.items()}, args.rounds)
    figures: dict[str, float] = {}
    for figure, by_kind in [("decode_request_bytes", {name: len(body) for name, body in sent.items()}),
                            ("decode_request_ms", build_ms), ("decode_parse_ms", parse_ms),
                            ("decode_read_ms", read_ms)]:
        figures[f"{figure}_with_pixels"] = by_kind["with_pixels"]
        figures[figure] = by_kind["withheld"]
        figures[f"{figure}_saved"] = by_kind["with_pixels"] / by_kind["withheld"]
    log(f"DecodeRequest {figures['decode_request_bytes_with_pixels'] / 2**20:.2f} MiB with its pixels, "
        f"{figures['decode_request_bytes']} bytes without: {figures['decode_request_bytes_saved']:.0f}x. "
        f"Gateway builds and serializes it in {build_ms['with_pixels']:.3f} ms with, {build_ms['withheld']:.3f} ms "
        f"without: {figures['decode_request_ms_saved']:.1f}x. Decode worker parses it in "
        f"{parse_ms['with_pixels']:.3f} ms with, {parse_ms['withheld']:.3f} ms without "
        f"({figures['decode_parse_ms_saved']:.1f}x), reads its images in {read_ms['with_pixels']:.3f} ms with, "
        f"{read_ms['withheld']:.3f} ms without ({figures['decode_read_ms_saved']:.1f}x); p50 of {args.rounds}")
    return {"image_tokens": num_image_tokens, **figures}


def chat(request_id: str, words: list[str], image_url: str | None) -> gateway_pb2.GenerateRequest:
    """A streamed chat of one user message, `words` then the image (if any), that samples two tokens: the first
    prefill's, the second the decode worker's."""
    message = common_pb2.ChatMessage(role="user", content_parts=[" ".join(words)])
    if image_url is not None:
        message.image_parts.append(1)
        message.image_urls.append(image_url)
    return gateway_pb2.GenerateRequest(
        request_id=request_id, chat=common_pb2.ChatMessages(messages=[message]),
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        stream_options=gateway_pb2.StreamOptions(stream=True))


def second_token_gap(stub: gateway_pb2_grpc.GenerateStub, request: gateway_pb2.GenerateRequest) -> tuple[float, int]:
    """Seconds from the first streamed token to the second, and the prompt's tokens (its usage's)."""
    arrivals, prompt_tokens = [], 0
    for response in stub.Generate(request, timeout=120):
        if response.HasField("error"):
            raise RuntimeError(f"{request.request_id}: {response.error.message}")
        if response.HasField("chunk") and response.chunk.token_ids:
            arrivals.extend([time.perf_counter()] * len(response.chunk.token_ids))
        elif response.HasField("complete"):
            prompt_tokens = response.complete.usage.prompt_tokens
    return arrivals[1] - arrivals[0], prompt_tokens


def bench_mesh(model_dir: Path, args) -> dict:
    """p50 gap between a chat's first and second token: with the photo, through the mesh's gateway and the one
    that sends its pixels to the decode worker; and without it, of as many prompt tokens."""
    url = photo_url(args.mesh_width, args.mesh_height)
    with test_mesh.running_mesh(model_dir, num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"),
                                gateway_args=GATEWAY_ARGS) as mesh:
        # A second gateway over the same workers: GatewayProcess runs `python -m services.gateway`, here
        # WITH_PIXELS_GATEWAY with the same arguments.
        with_pixels_spawn = (lambda argv, env=None:
                             spawn([sys.executable, "-c", WITH_PIXELS_GATEWAY, *argv[3:]], env=env))
        with mock.patch.object(test_mesh, "spawn", with_pixels_spawn):
            gateway = test_mesh.GatewayProcess(model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                                               [d.address for d in mesh.decode], *GATEWAY_ARGS)
        log(f"mesh up; a second gateway, sending pixels, at {gateway.grpc_address}")
        try:
            with client_channel(mesh.gateway.grpc_address) as channel, \
                    client_channel(gateway.grpc_address) as with_pixels_channel:
                gaps = sample_gaps(gateway_pb2_grpc.GenerateStub(channel),
                                   gateway_pb2_grpc.GenerateStub(with_pixels_channel), url, args)
        finally:
            assert gateway.terminate() == 0
    text_ms = p50_ms(gaps.pop("text"))
    image_ms, with_pixels_ms = p50_ms(gaps.pop("image")), p50_ms(gaps.pop("image_with_pixels"))
    log(f"From the first token to the second, p50 of {args.requests}: text chat {text_ms:.2f} ms; image chat "
        f"{image_ms:.2f} ms = {image_ms / text_ms:.2f}x text; image chat with its pixels sent to decode "
        f"{with_pixels_ms:.2f} ms = {with_pixels_ms / text_ms:.2f}x text, {with_pixels_ms / image_ms:.2f}x without")
    return {"text_gap_ms": text_ms, "image_gap_ms": image_ms, "image_gap_ms_with_pixels": with_pixels_ms,
            "image_gap_vs_text": image_ms / text_ms, "image_gap_with_pixels_vs_text": with_pixels_ms / text_ms,
            "image_gap_saved": with_pixels_ms / image_ms, **gaps}


def sample_gaps(stub: gateway_pb2_grpc.GenerateStub, with_pixels: gateway_pb2_grpc.GenerateStub, url: str,
                args) -> dict:
    """The three kinds of chat, alternating, each round starting one later, after one of each that warms its path
    and sizes the text chat to the image chat's prompt tokens. Each image chat's first word is its own (words
    w0.. for the mesh's gateway, w1.. for the other, w479 and w478 for warming up): the workers' prefix caches
    would otherwise hold a whole earlier prompt, the photo's tokens among them."""
    rng = random.Random(0)

    def words(n: int) -> list[str]:
        return [f"w{rng.randrange(480)}" for _ in range(n)]

    _, image_tokens = second_token_gap(stub, chat("warm-image", ["w479"], url))
    second_token_gap(with_pixels, chat("warm-image-with-pixels", ["w478"], url))
    _, one_word_tokens = second_token_gap(stub, chat("warm-text", words(1), None))
    num_words = image_tokens - one_word_tokens + 1
    measure: dict[str, Callable[[int], tuple[float, int]]] = {
        "image": lambda i: second_token_gap(stub, chat(f"image-{i}", [f"w{2 * i}"], url)),
        "image_with_pixels": lambda i: second_token_gap(with_pixels, chat(f"pixels-{i}", [f"w{2 * i + 1}"], url)),
        "text": lambda i: second_token_gap(stub, chat(f"text-{i}", words(num_words), None)),
    }
    names = list(measure)
    gaps: dict[str, list[float]] = {name: [] for name in names}
    prompt_tokens: dict[str, int] = {}
    for i in range(args.requests):
        for name in names[i % len(names):] + names[:i % len(names)]:
            # A pause before each: OpenMP threads spin for a while after a parallel region (mesh_overhead.py's).
            time.sleep(SETTLE_S)
            gap, prompt_tokens[name] = measure[name](i)
            gaps[name].append(gap)
    return {**gaps, "image_prompt_tokens": prompt_tokens["image"], "text_prompt_tokens": prompt_tokens["text"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--width", type=int, default=3000)
    parser.add_argument("--height", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=10, help="of each kind of chat (at most 239)")
    parser.add_argument("--mesh-width", type=int, default=1344)
    parser.add_argument("--mesh-height", type=int, default=1008)
    parser.add_argument("--no-mesh", action="store_true", help="the in-process figures only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-qwen2.5-vl"
        save_tiny_qwen_vl(model_dir)
        figures = bench_request(model_dir, args)
        if not args.no_mesh:
            figures |= bench_mesh(model_dir, args)
    print(json.dumps({name: round(value, 3) if isinstance(value, float) else value
                      for name, value in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
