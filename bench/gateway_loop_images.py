"""How long a chat with a large image holds the gateway's event loop while its prefill worker's request is made:
with its pixels put in the params, copied into the request and serialized with it (the gateway before
request_bytes.py), against the params without them and the pixels spliced into the request's bytes
(`given_to` and `with_inputs`, as the pipeline and the step sources now call them), alternating round by round
in this process. (Making the first on a thread held the loop 61 ms of its 160: protobuf holds the GIL through
each copy.)

    .venv/bin/python bench/gateway_loop_images.py [--rounds 20] [--side 3584] [--tokens 16384]

The image is --side x --side RGB (3584: Qwen2.5-VL's largest at its default max_pixels, 38.5 MB), its prompt
--tokens ids. While a request is made, a probe on the loop sleeps 1 ms at a time; the most any sleep overran is
what every other stream on the loop waited (`loop_blocked_ms*`, p50 over the rounds). `loop_blocked_saved` is the
figure with the pixels in the params over the one without. The last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from protos import common_pb2, prefill_pb2  # noqa: E402
from services.gateway.given_embeddings import GivenImages, ProcessedImage  # noqa: E402
from services.gateway.request_bytes import BulkInputs, with_inputs  # noqa: E402

PROBE_S = 0.001


async def _longest_overrun(stop: asyncio.Event) -> float:
    """The most a PROBE_S sleep overran until `stop` (seconds)."""
    longest = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        longest = max(longest, time.perf_counter() - start - PROBE_S)
    return longest


def _request(params: common_pb2.SamplingParams, tokens: list[int]) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id="r", token_ids=tokens, sampling=params,
                                      target={"decode_address": "127.0.0.1:1"})


async def in_params(images: GivenImages, tokens: list[int]) -> bytes:
    params = common_pb2.SamplingParams(max_tokens=16)
    params.images.extend(image.proto() for image in images.images)
    return _request(params, tokens).SerializeToString()


async def spliced(images: GivenImages, tokens: list[int]) -> bytes:
    params = common_pb2.SamplingParams(max_tokens=16)
    images.given_to(params)
    return with_inputs(_request(params, tokens), BulkInputs(images=images))


async def blocked_s(make, images: GivenImages, tokens: list[int]) -> tuple[float, float, int]:
    """The loop's longest wait while `make` makes one request, the time it took, and the request's bytes."""
    stop = asyncio.Event()
    probe = asyncio.ensure_future(_longest_overrun(stop))
    await asyncio.sleep(0.01)  # the probe running first
    start = time.perf_counter()
    made = await make(images, tokens)
    took = time.perf_counter() - start
    stop.set()
    return await probe, took, len(made)


async def main(args: argparse.Namespace) -> dict:
    rgb = bytes(range(256)) * (args.side * args.side * 3 // 256) + bytes(args.side * args.side * 3 % 256)
    images = GivenImages((ProcessedImage.of(rgb, (args.side, args.side, 3), 1 / 255, [0.5] * 3, [0.5] * 3),))
    tokens = list(range(args.tokens))
    runs = {"in_params": ([], []), "spliced": ([], [])}
    size = 0
    for _ in range(args.rounds):
        for name, make in (("in_params", in_params), ("spliced", spliced)):
            blocked, took, size = await blocked_s(make, images, tokens)
            runs[name][0].append(blocked)
            runs[name][1].append(took)
    figures = {"request_mib": round(size / 2**20, 1)}
    for name, (blocked, took) in runs.items():
        suffix = "_in_params" if name == "in_params" else ""
        figures[f"loop_blocked_ms{suffix}"] = round(statistics.median(blocked) * 1e3, 2)
        figures[f"request_ms{suffix}"] = round(statistics.median(took) * 1e3, 2)
    figures["loop_blocked_saved"] = round(figures["loop_blocked_ms_in_params"] / max(figures["loop_blocked_ms"],
                                                                                     1e-3), 1)
    print(f"a {args.side}x{args.side} image, {args.tokens} prompt tokens: a {figures['request_mib']} MiB prefill "
          f"request; the loop waited {figures['loop_blocked_ms_in_params']} ms while it was made with the pixels "
          f"in its params ({figures['request_ms_in_params']} ms), {figures['loop_blocked_ms']} ms while made with "
          f"them spliced in ({figures['request_ms']} ms): {figures['loop_blocked_saved']}x; p50 of {args.rounds}")
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--side", type=int, default=3584)
    parser.add_argument("--tokens", type=int, default=16384)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
