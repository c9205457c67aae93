"""What keeping freed host memory (engine/host_memory.py) saves a CPU prefill.

    .venv/bin/python bench/host_memory.py [--model DIR] [--prompt-tokens 512] [--requests 40]

Two engine processes on the same model, one with `retain_freed_host_memory` (the
default) and one with glibc's default malloc, are sent the same new prompts in turn,
request by request, so both see the same machine. Each times its own TTFT (add_request
to the first token, no service in between) and counts the minor page faults its process
took meanwhile. Printed: p50 TTFT of each and their ratio, and faults per request.

The last line of output is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import log  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402

SETTLE_S = 0.3  # OpenMP threads spin a while after a forward pass: the other process waits it out


def serve(connection, model_dir: str, retain: bool) -> None:
    """In a child process: one engine; for each prompt received, its (TTFT seconds, minor faults)."""
    from bench.mesh_overhead import inprocess_ttft
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=1024, retain_freed_host_memory=retain))
    connection.send(engine.model_config.vocab_size)
    for i, prompt in enumerate(iter(connection.recv, None)):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = inprocess_ttft(engine, f"r{i}", prompt)
        connection.send((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    model_dir = str(args.model or ensure_demo_model())
    context = multiprocessing.get_context("spawn")
    engines = {}
    for name, retain in (("retained", True), ("default", False)):
        parent, child = context.Pipe()
        process = context.Process(target=serve, args=(child, model_dir, retain), daemon=True)
        process.start()
        engines[name] = (process, parent)
    vocab_size = [connection.recv() for _, connection in engines.values()][0]
    from bench.mesh_overhead import random_prompts
    prompts = random_prompts(args.requests + args.warmup, args.prompt_tokens, vocab_size, seed=1)
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    try:
        for i, prompt in enumerate(prompts):
            order = list(engines) if i % 2 == 0 else list(reversed(engines))
            for name in order:
                time.sleep(SETTLE_S)
                connection = engines[name][1]
                connection.send(prompt)
                seconds, faults = connection.recv()
                if i >= args.warmup:
                    samples[name].append((seconds, faults))
    finally:
        for process, connection in engines.values():
            connection.send(None)
            process.join(10)
    figures = {}
    for name, values in samples.items():
        figures[f"ttft_{name}_p50_ms"] = round(statistics.median(s for s, _ in values) * 1e3, 3)
        figures[f"faults_per_request_{name}"] = statistics.median(f for _, f in values)
    figures["ttft_retained_over_default"] = round(figures["ttft_retained_p50_ms"] / figures["ttft_default_p50_ms"], 3)
    log(f"{args.prompt_tokens}-token prefill, p50 of {args.requests}: freed memory retained "
        f"{figures['ttft_retained_p50_ms']:.2f} ms ({figures['faults_per_request_retained']:.0f} page faults), "
        f"glibc's default {figures['ttft_default_p50_ms']:.2f} ms ({figures['faults_per_request_default']:.0f} "
        f"page faults); ratio {figures['ttft_retained_over_default']:.3f}")
    print(json.dumps({**figures, "prompt_tokens": args.prompt_tokens, "requests": args.requests}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
