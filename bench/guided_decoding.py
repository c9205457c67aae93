"""What structured output costs: decode throughput of guided requests against the same
requests unguided, and what a JSON schema costs before its first token over each tokenizer's
vocabulary.

    .venv/bin/python bench/guided_decoding.py [--model DIR] [--batch 16] [--max-tokens 64] [--rounds 5]

- Throughput: --batch requests of the same kind of prompt, greedy, run to the end through an
  `LLMEngine` in this process, once held to a regex (`guided_regex`, the lower-case words of
  a sentence: never finished early, so every guided request asks for a mask at each of its
  tokens), once to a grammar of the same words (`guided_grammar`, llguidance's parser) and
  once free, taking turns round by round so all see the same machine; output tokens per
  second of engine time, best round of each. guided_vs_unguided (grammar_vs_unguided) is the
  regex (grammar) figure over the free one; mask_ms_per_step (grammar_mask_ms_per_step) the
  difference in time per step.
- Before the first token, over the model's vocabulary and each of ../shared/models', in ms:
  the regex outlines-core would compile of a JSON schema with a string, an integer, an enum and
  an array (schema_compile_ms), and of any JSON object (json_object_compile_ms), cold, once each
  (the workers cache what they compile); against what the workers do with a JSON schema now,
  llguidance's JSON grammar of it: its matcher made and its first mask computed
  (schema_grammar_ms), with the vocabulary's llguidance tokenizer, made once per worker, apart
  (grammar_vocabulary_ms).

The last line of output is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from outlines_core.json_schema import build_regex_from_schema
from tokenizers import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.local_mesh import log  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.demo_model import ensure_demo_model  # noqa: E402
from engine.guided_decoding import GuideFactory, guide_bias  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from services.gateway.structured_output import ANY_JSON_OBJECT, schema_guide  # noqa: E402

WORDS = r"([a-z]+ )+"
WORDS_GRAMMAR = 'start: word+\nword: /[a-z]+/ " "'
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "colour", "tags"]}
SHARED_MODELS = REPO_ROOT.parent / "shared" / "models"


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, int]:
    """Output tokens, seconds of engine time and steps for the whole batch, run to the end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, params)
    tokens = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
        steps += 1
    return tokens, time.perf_counter() - start, steps


def compile_ms(tokenizer_path: Path, regex: str) -> float:
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    factory = GuideFactory(tokenizer, 0)
    start = time.perf_counter()
    factory.index(regex)
    return (time.perf_counter() - start) * 1e3


def grammar_ms(tokenizer_path: Path, grammar: str) -> tuple[float, float]:
    """(the vocabulary's llguidance tokenizer, then the grammar's matcher and first mask), in ms."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    factory = GuideFactory(tokenizer, 0)
    params = SamplingParams(guided_grammar=grammar)
    start = time.perf_counter()
    factory.compile(SamplingParams(guided_grammar='start: "warm"'))  # the tokenizer, once per worker
    made = time.perf_counter()
    guide_bias([factory.guide(params)], tokenizer.get_vocab_size(), torch.device("cpu"))
    return (made - start) * 1e3, (time.perf_counter() - made) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model_dir = args.model or ensure_demo_model()
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    vocab = engine.model_config.vocab_size
    prompts = [[(31 * i + 7 * j) % (vocab - 10) + 5 for j in range(args.prompt_tokens)] for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, guided_regex=WORDS)
    grammar = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                             guided_grammar=WORDS_GRAMMAR)
    modes = [("free", free), ("guided", guided), ("grammar", grammar)]
    for _, params in modes:
        engine.guides.compile(params)  # once, as a worker does before it adds the request
        run_batch(engine, prompts, params)  # warm-up
    best: dict[str, tuple[float, float]] = {}
    for round_ in range(args.rounds):
        for name, params in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
            tokens, seconds, steps = run_batch(engine, prompts, params)
            rate = tokens / seconds
            log(f"round {round_} {name}: {tokens} tokens in {seconds * 1e3:.0f} ms over {steps} steps, "
                f"{rate:.0f} tok/s")
            if name not in best or rate > best[name][0]:
                best[name] = (rate, seconds / steps)
    ratio = best["guided"][0] / best["free"][0]
    mask_ms = (best["guided"][1] - best["free"][1]) * 1e3
    log(f"regex-guided {best['guided'][0]:.0f} tok/s against free {best['free'][0]:.0f}: {ratio:.2f}x; "
        f"{mask_ms:.2f} ms more per step of {args.batch} guided rows")
    grammar_ratio = best["grammar"][0] / best["free"][0]
    grammar_mask_ms = (best["grammar"][1] - best["free"][1]) * 1e3
    log(f"grammar-guided {best['grammar'][0]:.0f} tok/s: {grammar_ratio:.2f}x; {grammar_mask_ms:.2f} ms more per "
        f"step of {args.batch} guided rows")
    regex, any_object = (build_regex_from_schema(json.dumps(schema)) for schema in (SCHEMA, ANY_JSON_OBJECT))
    grammar = schema_guide(SCHEMA).grammar
    tokenizers = {"model": Path(model_dir) / "tokenizer.json"}
    tokenizers.update({path.parent.name: path for path in sorted(SHARED_MODELS.glob("*/tokenizer.json"))}
                      if SHARED_MODELS.is_dir() else {})
    compiles, object_compiles, vocabularies, grammars = {}, {}, {}, {}
    for name, path in tokenizers.items():
        compiles[name], object_compiles[name] = compile_ms(path, regex), compile_ms(path, any_object)
        vocabularies[name], grammars[name] = grammar_ms(path, grammar)
        log(f"{name}'s vocabulary: the JSON schema's regex compiled in {compiles[name]:.0f} ms, any JSON "
            f"object's in {object_compiles[name]:.0f} ms; its JSON grammar's first mask in {grammars[name]:.1f} ms "
            f"(the vocabulary's llguidance tokenizer, once a worker: {vocabularies[name]:.0f} ms)")
    print(json.dumps({"guided_tok_s": round(best["guided"][0], 1), "unguided_tok_s": round(best["free"][0], 1),
                      "guided_vs_unguided": round(ratio, 3), "mask_ms_per_step": round(mask_ms, 3),
                      "grammar_tok_s": round(best["grammar"][0], 1), "grammar_vs_unguided": round(grammar_ratio, 3),
                      "grammar_mask_ms_per_step": round(grammar_mask_ms, 3),
                      "batch": args.batch, "max_tokens": args.max_tokens,
                      "schema_compile_ms": {k: round(v, 1) for k, v in compiles.items()},
                      "json_object_compile_ms": {k: round(v, 1) for k, v in object_compiles.items()},
                      "schema_grammar_ms": {k: round(v, 2) for k, v in grammars.items()},
                      "grammar_vocabulary_ms": {k: round(v, 1) for k, v in vocabularies.items()}}), flush=True)


if __name__ == "__main__":
    main()
