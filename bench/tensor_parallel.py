"""A model split across tensor-parallel ranks against the same model unsplit, on this host's cores.

    .venv/bin/python bench/tensor_parallel.py [--model 160m|7m] [--size 2] [--rounds 10]

Both engines live at once, each measured in turn round by round (the machine is shared and noisy):
the unsplit one computing with every core, the split one with its share of them in each rank (what
LLMEngine gives each rank unless told). Per round:
- prefill: time to the first token of a new random 512-token prompt (no prefix-cache hits);
- decode: 8 random 64-token prompts decoded together for 64 tokens each, output tokens/s.
Figures are p50s over the rounds, the ratios split over unsplit (above 1: the split engine is
faster). The greedy tokens of both must be the same, or the run stops. OpenMP spins as briefly as in
the prefill and decode workers (services/common/openmp_env.py): with its default spin, rank 0's extra
thread for the LM head (model_runner.every_core) holds a core the next step's other rank needs. On a CPU the ranks share
one memory bus and the sums between them cost a round trip through the kernel each, two a layer:
this measures what the split costs here, not what it gains on GPUs, where each rank has a device's
memory and bandwidth of its own. The last line is one JSON object.
"""
from __future__ import annotations

# isort: off
import services.common.openmp_env  # noqa: F401  (before torch loads OpenMP: its short spin, as the workers run)
# isort: on

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
from engine_throughput import ensure_model

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PREFILL_TOKENS = 512
DECODE_BATCH, DECODE_PROMPT, DECODE_OUTPUT = 8, 64, 64


def log(message: str) -> None:
    print(message, flush=True)


def prefill_seconds(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    outputs = list(engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    assert outputs[-1].finished
    return time.perf_counter() - start


def decoded(engine: LLMEngine, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Output tokens/s of the prompts decoded together, and each one's tokens."""
    params = SamplingParams(max_tokens=DECODE_OUTPUT, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    finished = {out.request_id: out.token_ids for out in engine.generate(prompts, params) if out.finished}
    elapsed = time.perf_counter() - start
    tokens = [finished[key] for key in sorted(finished, key=lambda key: int(key.rsplit("-", 1)[1]))]
    return len(prompts) * DECODE_OUTPUT / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="160m", help="a bench model's name (160m, 7m) or a model directory")
    parser.add_argument("--size", type=int, default=2, help="ranks the split engine runs (default 2)")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    model_dir = Path(args.model) if Path(args.model).is_dir() else ensure_model(args.model)
    cores = os.cpu_count() or 1
    threads = {1: cores, args.size: max(1, cores // args.size)}
    options = dict(model=str(model_dir), num_kv_blocks=DECODE_BATCH * 8 + PREFILL_TOKENS // 16 + 8,
                   max_num_batched_tokens=PREFILL_TOKENS)
    engines = {size: LLMEngine(EngineConfig(**options, tensor_parallel_size=size, num_threads=threads[size]))
               for size in (1, args.size)}
    vocab = engines[1].model_config.vocab_size
    rng = random.Random(0)
    samples: dict[str, dict[int, list[float]]] = {"prefill": {1: [], args.size: []}, "decode": {1: [], args.size: []}}
    log(f"{model_dir.name}: unsplit on {threads[1]} threads against {args.size} ranks on {threads[args.size]} each, "
        f"{args.rounds} rounds")
    for round_number in range(args.rounds):
        prefill_prompt = [rng.randrange(3, vocab) for _ in range(PREFILL_TOKENS)]
        decode_prompts = [[rng.randrange(3, vocab) for _ in range(DECODE_PROMPT)] for _ in range(DECODE_BATCH)]
        tokens = {}
        order = (1, args.size) if round_number % 2 == 0 else (args.size, 1)
        for size in order:
            torch.set_num_threads(threads[size])  # one process's setting: each engine's own while it runs
            engine = engines[size]
            samples["prefill"][size].append(prefill_seconds(engine, prefill_prompt))
            rate, tokens[size] = decoded(engine, decode_prompts)
            samples["decode"][size].append(rate)
            engine.reset_prefix_cache()  # the next round's prompts are new anyway
        if tokens[1] != tokens[args.size]:
            raise SystemExit(f"round {round_number}: the split engine's greedy tokens differ from the unsplit one's")
    for engine in engines.values():
        engine.close()
    prefill_ms = {size: statistics.median(values) * 1e3 for size, values in samples["prefill"].items()}
    decode_rate = {size: statistics.median(values) for size, values in samples["decode"].items()}
    figures = {
        "model": model_dir.name, "tensor_parallel_size": args.size, "threads_unsplit": threads[1],
        "threads_per_rank": threads[args.size],
        "prefill_512_ms_unsplit": round(prefill_ms[1], 2), "prefill_512_ms_split": round(prefill_ms[args.size], 2),
        "prefill_speedup": round(prefill_ms[1] / prefill_ms[args.size], 3),
        "decode_tokens_per_s_unsplit": round(decode_rate[1], 1),
        "decode_tokens_per_s_split": round(decode_rate[args.size], 1),
        "decode_speedup": round(decode_rate[args.size] / decode_rate[1], 3),
    }
    log(f"prefill of {PREFILL_TOKENS} tokens: {prefill_ms[1]:.1f} ms unsplit, {prefill_ms[args.size]:.1f} ms split "
        f"({figures['prefill_speedup']:.2f}x); decode at batch {DECODE_BATCH}: {decode_rate[1]:.0f} tokens/s unsplit, "
        f"{decode_rate[args.size]:.0f} split ({figures['decode_speedup']:.2f}x); greedy tokens identical")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
