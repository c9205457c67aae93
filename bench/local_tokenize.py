"""Text prompts encoded in the gateway against encoded by the tokenizer service: TTFT and the ledger's `tokenize`.

    .venv/bin/python bench/local_tokenize.py [--model DIR] [--requests 40] [--prompt-chars 1500]

Two meshes by `baton up` (1 prefill, 1 decode each), up at the same time: one as it
starts by default (the gateway encodes prompts of up to 2048 characters itself, with
the same tokenizer and chat template) and one with `--local-tokenize-max-chars 0` (the
tokenizer service encodes every prompt, a gRPC round trip on the request's path).
Streamed completions (a text prompt) and chat completions (a system and a user message)
of --prompt-chars characters of new random words each, so no prefix-cache hits,
alternate between the two meshes request by request, after the same pause as
bench/mesh_overhead.py. For each: TTFT p50 at the client, and the p50 of the gateway
ledger's `tokenize` phase (GET /v1/requests/{id}/timeline), from the request's
arrival to its token ids. The last line of output is one JSON object with every figure;
`ttft_ratio_*` is local over service (below 1: encoding in the gateway is faster).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402

SETTLE_S = 0.3  # as bench/mesh_overhead.py
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud ember").split()


def random_text(rng: random.Random, num_chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < num_chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:num_chars]


def streamed(client: httpx.Client, mesh: LocalMesh, kind: str, text: str) -> tuple[float, float]:
    """(seconds to the first chunk, the ledger's tokenize seconds) of one streamed greedy request."""
    body = {"model": mesh.model_name, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    if kind == "text":
        path, body["prompt"] = "completions", text
    else:
        half = len(text) // 2
        path, body["messages"] = "chat/completions", [{"role": "system", "content": text[:half]},
                                                      {"role": "user", "content": text[half:]}]
    start = time.perf_counter()
    first = request_id = None
    with client.stream("POST", f"http://{mesh.http}/v1/{path}", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
                request_id = json.loads(line.removeprefix("data: "))["id"]
    timeline = client.get(f"http://{mesh.http}/v1/requests/{request_id}/timeline").json()
    return first, timeline["choices"][0]["phases_ms"]["tokenize"] / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--requests", type=int, default=40, help="per kind of request and mesh")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-chars", type=int, default=1500)
    args = parser.parse_args(argv)
    model_dir = args.model or ensure_demo_model()

    meshes = {"local": LocalMesh(model_dir, "--no-kvstore")}
    try:
        meshes["service"] = LocalMesh(model_dir, "--no-kvstore", "--gateway-args=--local-tokenize-max-chars 0")
        log(f"model {model_dir}; meshes up: {', '.join(f'{n} {m.http}' for n, m in meshes.items())}")
        rng = random.Random(3)
        ttft: dict[tuple[str, str], list[float]] = {}
        tokenize: dict[tuple[str, str], list[float]] = {}
        with httpx.Client(timeout=120) as client:
            for i in range(args.warmup + args.requests):
                for kind in ("text", "chat"):
                    for name, mesh in meshes.items():
                        time.sleep(SETTLE_S)
                        first, tokenize_s = streamed(client, mesh, kind, random_text(rng, args.prompt_chars))
                        if i >= args.warmup:
                            ttft.setdefault((kind, name), []).append(first)
                            tokenize.setdefault((kind, name), []).append(tokenize_s)
    finally:
        for mesh in meshes.values():
            mesh.stop()

    p50_ms = lambda samples: statistics.median(samples) * 1e3  # noqa: E731
    figures: dict[str, float | int] = {"prompt_chars": args.prompt_chars, "requests": args.requests}
    for kind in ("text", "chat"):
        for name in meshes:
            figures[f"tokenize_{kind}_{name}_ms"] = round(p50_ms(tokenize[kind, name]), 3)
            figures[f"ttft_{kind}_{name}_ms"] = round(p50_ms(ttft[kind, name]), 3)
        figures[f"ttft_ratio_{kind}"] = round(figures[f"ttft_{kind}_local_ms"] / figures[f"ttft_{kind}_service_ms"], 3)
        log(f"{kind}: tokenize p50 {figures[f'tokenize_{kind}_local_ms']:.2f} ms in the gateway against "
            f"{figures[f'tokenize_{kind}_service_ms']:.2f} ms by the tokenizer service; TTFT p50 "
            f"{figures[f'ttft_{kind}_local_ms']:.2f} against {figures[f'ttft_{kind}_service_ms']:.2f} ms, "
            f"ratio {figures[f'ttft_ratio_{kind}']:.3f}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
