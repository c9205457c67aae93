"""Speculative decoding with n-gram drafts against plain decoding, on the same engine and prompts.

    .venv/bin/python bench/speculative_decoding.py [--model 160m|7m] [--drafts 4] [--repeats 2]

Random weights make no real model's output, so the run brackets one instead, greedy, batch 1 and
batch 8:
- `cycling`: the demo model with every attention output projection zeroed, so that each token is
  computed from its predecessor alone (attention still computed, its result dropped): its greedy
  output walks a cycle of tokens, and each prompt is 64 random tokens and then that cycle twice
  over, so the output goes on as the prompt did: the best case for n-gram drafts (a real model's
  output repeats its prompt or itself in code edits, extraction, summaries, less wholly);
- `random`: the demo model as it is, on random 128-token prompts: its output hardly ever repeats,
  drafts are rarely proposed and rarely right, so what the figure shows is their cost.
Each is decoded plainly and with drafts, alternating, best of `--repeats`; the tokens must be
identical (the engine makes the same ones either way), and the figure is the ratio of output
tokens/s, drafts over plain, printed beside the acceptance rate. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch
from engine_throughput import ensure_model
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config_loader import load_model_config
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig

OUTPUT_LEN = 128


def cycling_copy(model_dir: Path) -> Path:
    """A copy of the model with every attention output projection zeroed (made once, beside it)."""
    target = model_dir.with_name(model_dir.name + "-cycling")
    if not (target / "model.safetensors").is_file():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(model_dir, target)
        tensors = load_file(target / "model.safetensors")
        save_file({name: torch.zeros_like(t) if name.endswith("o_proj.weight") else t for name, t in tensors.items()},
                  target / "model.safetensors")
    return target


def cycle_prompts(model_dir: Path, vocab: int, num: int, rng: random.Random) -> list[list[int]]:
    """Prompts that end in two turns of a cycle of the `cycling` model's greedy next-token map."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=1024, max_num_seqs=256))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    outputs = {out.request_id: out.token_ids[0] for out in engine.generate([[t] for t in range(vocab)], one)}
    following = [outputs[f"gen-{t}"] for t in range(vocab)]  # the engine numbers requests from 0
    prompts = []
    for _ in range(num):
        seen: dict[int, int] = {}
        token = rng.randrange(vocab)
        while token not in seen:
            seen[token] = len(seen)
            token = following[token]
        cycle = list(seen)[seen[token]:]
        prompts.append([rng.randrange(vocab) for _ in range(64)] + cycle * 2)
    return prompts


def run(model_dir, prompts: list[list[int]], batch: int, speculative: SpeculativeConfig | None):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=1024, max_num_seqs=batch,
                                    speculative=speculative))
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    start = time.perf_counter()
    outputs = {out.request_id: out.token_ids for out in engine.generate(prompts, params) if out.finished}
    elapsed = time.perf_counter() - start
    tokens = [outputs[k] for k in sorted(outputs, key=lambda r: int(r.removeprefix("gen-")))]
    scheduler = engine.scheduler
    return tokens, sum(map(len, tokens)) / elapsed, scheduler.num_draft_tokens, scheduler.num_accepted_tokens


def compare(key: str, model_dir, prompts: list[list[int]], batch: int, speculative: SpeculativeConfig,
            repeats: int, prefix: str = "spec_decode") -> dict[str, float]:
    """Decode plainly and with drafts, alternating, best of `repeats`; print the ratio of output
    tokens/s and the acceptance; return them as figures named `{prefix}_speedup_{key}` and so on."""
    best = {"plain": 0.0, "drafts": 0.0}
    for _ in range(repeats):
        plain, plain_rate, _, _ = run(model_dir, prompts, batch, None)
        drafted, drafted_rate, num_drafts, num_accepted = run(model_dir, prompts, batch, speculative)
        if drafted != plain:
            raise SystemExit(f"{key}: drafted tokens differ from plain decoding")
        best = {"plain": max(best["plain"], plain_rate), "drafts": max(best["drafts"], drafted_rate)}
    ratio = best["drafts"] / best["plain"]
    accepted = num_accepted / num_drafts if num_drafts else 0.0
    num_tokens = len(prompts) * OUTPUT_LEN
    tokens_per_step = num_tokens / (num_tokens - num_accepted)
    print(f"{key:20s}: plain {best['plain']:7.1f} tok/s, drafts {best['drafts']:7.1f} tok/s -> {ratio:.2f}x; "
          f"{num_drafts} drafts, {accepted:.0%} accepted, {tokens_per_step:.2f} tokens a sequence's step", flush=True)
    return {f"{prefix}_speedup_{key}": round(ratio, 3), f"{prefix}_acceptance_{key}": round(accepted, 3),
            f"{prefix}_tokens_per_step_{key}": round(tokens_per_step, 3)}


def bench_args(description: str, drafts: int) -> argparse.Namespace:
    """A speculative decoding bench's flags: --model, --drafts (`drafts` unless given), --repeats."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="160m", choices=("7m", "160m"))
    parser.add_argument("--drafts", type=int, default=drafts, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args()


def vocab_size(model_dir: Path) -> int:
    return load_model_config(model_dir).vocab_size


def compare_on_random_prompts(name: str, model_dir, vocab_size: int, speculative: SpeculativeConfig, repeats: int,
                              prefix: str) -> dict[str, float]:
    """`compare` at batch 1 (4 prompts) and batch 8 (8 prompts), on random 128-token prompts of `vocab_size`
    tokens: the figures named `{prefix}_..._{name}_batch1` and `..._batch8`."""
    figures: dict[str, float] = {}
    for batch in (1, 8):
        rng, num = random.Random(batch), 8 if batch > 1 else 4
        prompts = [[rng.randrange(vocab_size) for _ in range(128)] for _ in range(num)]
        figures.update(compare(f"{name}_batch{batch}", model_dir, prompts, batch, speculative, repeats, prefix))
    return figures


def main() -> None:
    args = bench_args(__doc__, drafts=4)
    model_dirs = {"cycling": cycling_copy(ensure_model(args.model)), "random": ensure_model(args.model)}
    speculative = SpeculativeConfig(num_speculative_tokens=args.drafts)
    figures: dict[str, float] = {}
    for name, model_dir in model_dirs.items():
        vocab = vocab_size(model_dir)
        for batch in (1, 8):
            rng, num = random.Random(batch), 8 if batch > 1 else 4
            prompts = (cycle_prompts(model_dir, vocab, num, rng) if name == "cycling" else
                       [[rng.randrange(vocab) for _ in range(128)] for _ in range(num)])
            figures.update(compare(f"{name}_batch{batch}", model_dir, prompts, batch, speculative, args.repeats))
    print(json.dumps({"model": args.model, "num_speculative_tokens": args.drafts, **figures}))


if __name__ == "__main__":
    main()
