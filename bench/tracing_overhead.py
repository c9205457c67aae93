"""What tracing costs: TTFT through a mesh with OpenTelemetry on against the same mesh with it off.

    .venv/bin/python bench/tracing_overhead.py [--model DIR] [--prompt-tokens 512] [--requests 200]

Two `baton up` meshes (gateway, tokenizer, 1 prefill, 1 decode each) run side by side:
one with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP gRPC receiver in this process
(every service exports its spans there, batched, as it would to a collector), one with
`OTEL_TRACES_EXPORTER=none`. Requests alternate between them one at a time, so both see
the same machine: streamed completions of a new --prompt-tokens prompt each (no
prefix-cache hits), 16 tokens out. TTFT is the time to the first streamed chunk.

tracing_overhead_pct = (p50 on / p50 off − 1) × 100 (target < 3). The receiver's span
count per request shows the traced mesh really traced. The last line of output is one
JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import LocalMesh, log, streamed_ttft  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.model_config_loader import load_model_config  # noqa: E402

SETTLE_S = 0.2  # between requests: OpenMP threads spinning after one request would slow the next


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts what it is sent and keeps nothing."""

    def __init__(self) -> None:
        self.num_spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        count = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        with self._lock:
            self.num_spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200,
                        help="timed requests per mesh (fewer: the p50s swing by ~1 ms)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--traced-env", action="append", default=[], metavar="NAME=VALUE",
                        help="another variable for the traced mesh (e.g. OTEL_TRACES_SAMPLER=traceidratio)")
    args = parser.parse_args(argv)
    model_dir = args.model or ensure_demo_model()
    vocab = load_model_config(model_dir).vocab_size
    log(f"model {model_dir}; torch threads {torch.get_num_threads()}")

    counter = SpanCounter()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, receiver)
    receiver_port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    meshes: dict[str, LocalMesh] = {}
    try:
        meshes["off"] = LocalMesh(model_dir, env={"OTEL_TRACES_EXPORTER": "none"})
        traced_env = dict(item.split("=", 1) for item in args.traced_env)
        meshes["on"] = LocalMesh(model_dir, env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}",
                                                 **traced_env})
        log(f"meshes up: tracing off at {meshes['off'].http}, on at {meshes['on'].http} "
            f"(spans to 127.0.0.1:{receiver_port})")
        rng = random.Random(1)
        samples: dict[str, list[float]] = {"off": [], "on": []}
        spans_before = 0
        with httpx.Client(timeout=120) as client:
            for i in range(args.warmup + args.requests):
                if i == args.warmup:
                    time.sleep(6.0)  # the warm-up's spans are exported (5 s batches) before counting starts
                    spans_before = counter.num_spans
                # Which goes first alternates, so neither always follows the other's spinning threads.
                for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    time.sleep(SETTLE_S)
                    prompt = [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)]
                    seconds = streamed_ttft(client, meshes[name], prompt, args.max_tokens)
                    if i >= args.warmup:
                        samples[name].append(seconds)
        time.sleep(6.0)  # the last batch is exported
        spans_per_request = (counter.num_spans - spans_before) / args.requests
    finally:
        for mesh in meshes.values():
            mesh.stop()
        receiver.stop(grace=1)

    off_ms, on_ms = p50_ms(samples["off"]), p50_ms(samples["on"])
    overhead_pct = (on_ms / off_ms - 1) * 100
    paired = statistics.median(on - off for on, off in zip(samples["on"], samples["off"])) * 1e3
    log(f"TTFT p50 of {args.requests} streamed {args.prompt_tokens}-token prompts: tracing off {off_ms:.2f} ms, "
        f"on {on_ms:.2f} ms: overhead {overhead_pct:+.2f} % (target < 3 %); median paired difference "
        f"{paired:+.3f} ms; {spans_per_request:.1f} spans exported per traced request")
    print(json.dumps({"ttft_p50_off_ms": round(off_ms, 3), "ttft_p50_on_ms": round(on_ms, 3),
                      "tracing_overhead_pct": round(overhead_pct, 2), "paired_difference_ms": round(paired, 3),
                      "spans_per_request": round(spans_per_request, 1), "prompt_tokens": args.prompt_tokens,
                      "requests": args.requests}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
