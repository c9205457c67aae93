"""Embeddings (`/v1/embeddings`' work, SamplingParams.embed) from Baton's engine against
`transformers`' AutoModel on the same model and inputs, in the same run.

    .venv/bin/python bench/embeddings.py [--model 160m|7m|minilm|modernbert] [--inputs 64] [--repeats 3] [--per-token]

The inputs are random token sequences of 32 to 256 tokens. The baseline embeds them as an embedding
library does with transformers: batches of `--batch` padded on the right, the last real token's
hidden state read from `last_hidden_state` (for `minilm`, a BERT encoder shaped as
all-MiniLM-L6-v2 with random weights, and `modernbert`, a ModernBERT shaped as modernbert-embed-base:
the mean of the real tokens' hidden states, as sentence-transformers pools it), normalized. Baton's
engine is given them all at once and batches them as it batches any prompts (chunked,
`max_num_batched_tokens`; an encoder's inputs whole). Each side runs
`--repeats` times, alternating, best kept; the two sides' embeddings must agree (cosine > 0.9999).
The figure is the ratio of input tokens embedded per second, Baton over transformers. With
`--per-token`, every token's hidden state instead (vLLM's token_embed: SamplingParams.embed_tokens
against the baseline's real rows of `last_hidden_state`), each normalized. The last line is one
JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import transformers
from engine_throughput import MODEL_CACHE, MODELS, ensure_model

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

EMBED = SamplingParams(max_tokens=1, embed=True)
EMBED_TOKENS = SamplingParams(max_tokens=1, embed=True, embed_tokens=True)


# all-MiniLM-L6-v2's shape, a BERT encoder pooled by the mean of its tokens; modernbert-embed-base's.
ENCODERS = {
    "minilm": ("BertModel", "BertConfig", dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                                               num_attention_heads=12, intermediate_size=1536,
                                               max_position_embeddings=512)),
    "modernbert": ("ModernBertModel", "ModernBertConfig", dict(vocab_size=50368, hidden_size=768, num_hidden_layers=22,
                                                               num_attention_heads=12, intermediate_size=1152,
                                                               max_position_embeddings=8192, local_attention=128)),
}


def ensure_encoder(name: str) -> Path:
    """The cached encoder of that shape, random weights, with its sentence-transformers mean Pooling module."""
    target = MODEL_CACHE / name
    if not (target / "modules.json").is_file():
        architecture, config_class, shape = ENCODERS[name]
        torch.manual_seed(0)
        getattr(transformers, architecture)(getattr(transformers, config_class)(**shape)).save_pretrained(target)
        (target / "1_Pooling").mkdir(exist_ok=True)
        (target / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
        (target / "modules.json").write_text(json.dumps(
            [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    return target


def transformers_embeddings(model, inputs: list[list[int]], batch: int, mean: bool,
                            per_token: bool = False) -> list[torch.Tensor]:
    """Each input's embedding ([H]), or with `per_token` its real tokens' ([P, H]), normalized."""
    made = []
    with torch.inference_mode():
        for start in range(0, len(inputs), batch):
            group = inputs[start:start + batch]
            longest = max(map(len, group))
            ids = torch.tensor([seq + [0] * (longest - len(seq)) for seq in group])
            mask = torch.tensor([[1] * len(seq) + [0] * (longest - len(seq)) for seq in group])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            if per_token:
                made += [torch.nn.functional.normalize(hidden[i, :len(seq)], dim=-1) for i, seq in enumerate(group)]
                continue
            if mean:
                pooled = (hidden * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True)
            else:
                pooled = hidden[torch.arange(len(group)), torch.tensor([len(seq) - 1 for seq in group])]
            made += list(torch.nn.functional.normalize(pooled, dim=-1))
    return made


def baton_embeddings(engine: LLMEngine, inputs: list[list[int]], per_token: bool = False) -> list[torch.Tensor]:
    finished = {o.request_id: o for o in engine.generate(inputs, EMBED_TOKENS if per_token else EMBED) if o.finished}
    ordered = sorted(finished, key=lambda r: int(r.removeprefix("gen-")))
    if per_token:
        return [torch.nn.functional.normalize(finished[r].token_embeddings, dim=-1) for r in ordered]
    return [torch.nn.functional.normalize(torch.tensor(finished[r].embedding), dim=0) for r in ordered]


def timed(fn) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    made = fn()
    return time.perf_counter() - start, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="160m", choices=[*sorted(MODELS), *ENCODERS])
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="the baseline's batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-token", action="store_true", help="every token's hidden state (token_embed)")
    args = parser.parse_args()
    is_encoder = args.model in ENCODERS
    model_dir = ensure_encoder(args.model) if is_encoder else ensure_model(args.model)
    rng = random.Random(0)
    vocab = (ENCODERS[args.model][2] if is_encoder else MODELS[args.model])["vocab_size"]
    inputs = [[rng.randrange(vocab) for _ in range(rng.randint(32, 256))] for _ in range(args.inputs)]
    num_tokens = sum(map(len, inputs))
    hf = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Room for every input at once, and none of them read from the prefix cache on a repeat.
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=num_tokens // 16 + 2 * args.inputs,
                                    enable_prefix_caching=False))
    baton_s, theirs_s = [], []
    for _ in range(args.repeats):
        seconds, ours = timed(lambda: baton_embeddings(engine, inputs, args.per_token))
        baton_s.append(seconds)
        seconds, theirs = timed(lambda: transformers_embeddings(hf, inputs, args.batch, mean=is_encoder,
                                                                per_token=args.per_token))
        theirs_s.append(seconds)
        cosine = min(float((a * b).sum(dim=-1).min()) for a, b in zip(ours, theirs))
        assert cosine > 0.9999, f"Baton's embeddings differ from transformers' (cosine {cosine})"
    baton_rate, theirs_rate = num_tokens / min(baton_s), num_tokens / min(theirs_s)
    task = "token_embed" if args.per_token else "embed"
    print(f"[{args.model}, {task}] {args.inputs} inputs, {num_tokens} tokens; lowest cosine to transformers' "
          f"{cosine:.6f}")
    print(f"Baton engine:  {baton_rate:10.0f} tokens/s ({args.inputs / min(baton_s):.1f} inputs/s)")
    print(f"transformers:  {theirs_rate:10.0f} tokens/s ({args.inputs / min(theirs_s):.1f} inputs/s, "
          f"batch {args.batch})")
    print(f"ratio: {baton_rate / theirs_rate:.2f}x")
    print(json.dumps({"model": args.model, "task": task, "inputs": args.inputs, "tokens": num_tokens,
                      "baton_embed_tokens_per_s": round(baton_rate, 1),
                      "transformers_embed_tokens_per_s": round(theirs_rate, 1),
                      "embed_throughput_ratio": round(baton_rate / theirs_rate, 3),
                      "min_cosine_to_transformers": round(cosine, 6)}))


if __name__ == "__main__":
    main()
