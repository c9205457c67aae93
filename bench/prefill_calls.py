"""Prompts sent to the prefill worker on a call opened ahead of them against on a new call each: the mesh's overhead.

    .venv/bin/python bench/prefill_calls.py [--model DIR] [--requests 40] [--prompt-tokens 512]

Two meshes by `baton up` (1 prefill, 1 decode each), up at the same time: one as it
starts by default (the gateway keeps a call open to the prefill worker and sends each
prompt as that call's request: services/gateway/kept_calls.py) and one with
`--prefill-calls new` (a new PrefillStream call per prompt). The same kind of
--prompt-tokens-token prompts (token ids, each new, so no prefix-cache hits) alternate
between the two by the public gRPC API, after bench/mesh_overhead.py's pause, and an
empty round trip (a health Check) follows each pair. For each mesh: the p50 over
requests of TTFT less the prefill worker's own engine time for that request (from the
gateway's ledger), mesh_overhead's `overhead_ms`, in ms and in empty round trips; and
how many prompts each gateway sent on a kept call (its
`baton_gateway_prefill_calls_total`). The last line of output is one JSON object with
every figure; `overhead_saved_ms` is new less preopened.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
from grpc_health.v1 import health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log  # noqa: E402
from bench.mesh_overhead import (  # noqa: E402
    SETTLE_S,
    client_channel,
    empty_round_trip,
    engine_ttft_seconds,
    grpc_ttft,
    random_prompts,
)
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.model_config_loader import load_model_config  # noqa: E402
from protos import gateway_pb2_grpc  # noqa: E402


def calls_made(client: httpx.Client, mesh: LocalMesh) -> dict[str, float]:
    """The gateway's prompts to prefill workers so far, by the call that carried them."""
    text = client.get(f"http://{mesh.http}/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^baton_gateway_prefill_calls_total\{call="(\w+)"[^}]*\} (\S+)$', text, re.M)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--requests", type=int, default=40, help="per mesh")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    model_dir = args.model or ensure_demo_model()
    vocab = load_model_config(model_dir).vocab_size

    meshes = {"preopened": LocalMesh(model_dir, "--no-kvstore")}
    try:
        meshes["new"] = LocalMesh(model_dir, "--no-kvstore", "--gateway-args=--prefill-calls new")
        log(f"model {model_dir}; meshes up: {', '.join(f'{n} {m.grpc}' for n, m in meshes.items())}")
        prompts = iter(random_prompts(len(meshes) * (args.warmup + args.requests), args.prompt_tokens, vocab, seed=4))
        overhead: dict[str, list[float]] = {name: [] for name in meshes}
        rtt: list[float] = []
        with httpx.Client(timeout=120) as client:
            channels = {name: client_channel(mesh.grpc) for name, mesh in meshes.items()}
            try:
                stubs = {name: gateway_pb2_grpc.GenerateStub(channel) for name, channel in channels.items()}
                health = health_pb2_grpc.HealthStub(channels["new"])
                for i in range(args.warmup + args.requests):
                    for name, mesh in meshes.items():
                        time.sleep(SETTLE_S)
                        request_id = f"prefill-calls-{name}-{i}"
                        ttft, _ = grpc_ttft(stubs[name], next(prompts), request_id)
                        timeline = client.get(f"http://{mesh.http}/v1/requests/{request_id}/timeline").json()
                        if i >= args.warmup:
                            overhead[name].append(ttft - engine_ttft_seconds(timeline))
                    time.sleep(SETTLE_S)
                    seconds = empty_round_trip(health)
                    if i >= args.warmup:
                        rtt.append(seconds)
            finally:
                for channel in channels.values():
                    channel.close()
            calls = {name: calls_made(client, mesh) for name, mesh in meshes.items()}
    finally:
        for mesh in meshes.values():
            mesh.stop()

    rtt_ms = statistics.median(rtt) * 1e3
    figures: dict[str, float | int] = {"prompt_tokens": args.prompt_tokens, "requests": args.requests,
                                       "rtt_ms": round(rtt_ms, 4)}
    for name in meshes:
        ms = statistics.median(overhead[name]) * 1e3
        figures[f"overhead_{name}_ms"] = round(ms, 3)
        figures[f"overhead_{name}_rtt_units"] = round(ms / rtt_ms, 2)
        figures[f"calls_preopened_{name}"] = int(calls[name].get("preopened", 0))
        log(f"{name}: overhead p50 {ms:.2f} ms = {ms / rtt_ms:.2f} empty round trips of {rtt_ms:.3f} ms; "
            f"prompts on kept calls {calls[name].get('preopened', 0):.0f}, on new ones {calls[name].get('new', 0):.0f}")
    figures["overhead_saved_ms"] = round(figures["overhead_new_ms"] - figures["overhead_preopened_ms"], 3)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
