"""A long prompt's KV pages sent while it computes, against sent after its first token, when pages go by
the gRPC stream as between hosts: the waits for the first token and from it to the second.

    .venv/bin/python bench/early_kv_transfer.py [--prompt-tokens 1536] [--chunk-tokens 128] [--requests 12]
                                                [--device cuda]

Two meshes by `baton up` (1 prefill, 1 decode each; --kv-transport grpc-stream, as a decode worker
on another host gets its pages), up at the same time: one with prefill workers started with
--early-kv-transfer on (a prompt computed in several chunks sends each chunk's pages as the next
computes: services/prefill/early_pages.py) and one with it off (every page after the first token).
Their prefill workers compute --chunk-tokens a step. The model is a demo model with more KV per token
than the default one (8 layers of 8 heads of 64: 32 KiB a token in float32), so that a prompt's pages
take the stream a while. The same kind of --prompt-tokens prompts (token ids, each new: no
prefix-cache hits) alternate between the two by the public gRPC API. For each mesh, p50 over
requests: the time to the first token (TTFT) and from it to the second (TTST: the pages' handoff and
the decode worker's first step, which early pages shorten). The ratios are on / off in the same run;
the last line of output is one JSON object with every figure.

On a CPU the pages' sending (gathering, CRC-32, gRPC) takes the cores the prompt computes on, and
here, with every process on one 2-core host, the decode worker's receiving too: TTFT grows by more
than TTST shrinks, which is why --early-kv-transfer auto sends early only from a GPU worker.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log  # noqa: E402
from bench.mesh_overhead import SETTLE_S, client_channel, grpc_ttft, random_prompts  # noqa: E402
from engine.demo_model import make_demo_model  # noqa: E402
from protos import gateway_pb2_grpc  # noqa: E402

VOCAB_SIZE = 2048


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--chunk-tokens", type=int, default=128, help="the prefill workers' tokens per step")
    parser.add_argument("--requests", type=int, default=12, help="per mesh")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the workers compute: cpu, cuda or cuda:N")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_demo_model(Path(tmp) / "kv-heavy", hidden_size=512, num_layers=8, num_heads=8,
                                    num_kv_heads=8, vocab_size=VOCAB_SIZE, seed=3)
        common = ("--no-kvstore", "--device", args.device,
                  "--gateway-args=--kv-transport grpc-stream --local-prefill-max-tokens 0")
        chunk = f"--max-num-batched-tokens {args.chunk_tokens}"
        meshes = {"early": LocalMesh(model_dir, *common, f"--prefill-args={chunk} --early-kv-transfer on")}
        try:
            meshes["after"] = LocalMesh(model_dir, *common, f"--prefill-args={chunk} --early-kv-transfer off")
            figures = measure(meshes, args)
        finally:
            for mesh in meshes.values():
                mesh.stop()
    early, after = figures["early"], figures["after"]
    result = {"ttst_early_p50_ms": early["ttst_p50_ms"], "ttst_after_p50_ms": after["ttst_p50_ms"],
              "ttst_ratio": round(early["ttst_p50_ms"] / after["ttst_p50_ms"], 3),
              "ttft_early_p50_ms": early["ttft_p50_ms"], "ttft_after_p50_ms": after["ttft_p50_ms"],
              "ttft_ratio": round(early["ttft_p50_ms"] / after["ttft_p50_ms"], 3),
              "prompt_tokens": args.prompt_tokens, "chunk_tokens": args.chunk_tokens, "requests": args.requests,
              "device": args.device,
              "kv_bytes_per_prompt": args.prompt_tokens * 2 * 8 * 8 * 64 * 4}
    log(f"{args.prompt_tokens}-token prompts, {args.chunk_tokens} a step, pages by the gRPC stream: the second "
        f"token {early['ttst_p50_ms']:.1f} ms after the first with pages sent as they compute, "
        f"{after['ttst_p50_ms']:.1f} ms with them sent after it (x{result['ttst_ratio']}); first token "
        f"{early['ttft_p50_ms']:.1f} against {after['ttft_p50_ms']:.1f} ms (x{result['ttft_ratio']}), p50 of "
        f"{args.requests}")
    print(json.dumps(result))
    return 0


def measure(meshes: dict[str, LocalMesh], args) -> dict[str, dict[str, float]]:
    stubs = {name: gateway_pb2_grpc.GenerateStub(client_channel(mesh.grpc)) for name, mesh in meshes.items()}
    prompts = random_prompts(len(meshes) * (args.requests + args.warmup), args.prompt_tokens, VOCAB_SIZE, seed=9)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in meshes}
    names = list(meshes)
    for i in range(args.requests + args.warmup):
        for j, name in enumerate(names[i % 2:] + names[:i % 2]):  # each round starting with the other
            time.sleep(SETTLE_S)
            ttft, ttst = grpc_ttft(stubs[name], prompts.pop(), f"{name}-{i}-{j}")
            if i >= args.warmup:
                samples[name].append((ttft, ttst))
    return {name: {"ttft_p50_ms": round(1e3 * statistics.median(s[0] for s in got), 2),
                   "ttst_p50_ms": round(1e3 * statistics.median(s[1] for s in got), 2)}
            for name, got in samples.items()}


if __name__ == "__main__":
    sys.exit(main())
