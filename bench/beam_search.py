"""Beam search (`use_beam_search`) through a real mesh against `transformers.generate(num_beams=...)`
on the same model and prompts, in the same run.

    .venv/bin/python bench/beam_search.py [--model 7m|160m] [--width 4] [--max-tokens 32] [--prompts 4]

`baton up` serves the model (one prefill and one decode worker, each its own process); each
prompt (random token ids, `--prompt-len` of them) is searched by the gateway over the mesh (one
request per live beam each step: services/gateway/beam_search.py) and by transformers in this
process, one after the other, EOS ignored on both sides (every beam runs `--max-tokens`). The
beams must be the same (their tokens, best first); the figure is the ratio of wall time,
transformers over Baton, per prompt, best of `--repeats`. transformers keeps its beams' KV cache
between steps; the gateway's steps reuse the prefill worker's prefix cache a page at a time, and
each is a round of gRPC calls, so this is where the gateway's way costs. The last line is one
JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import httpx
import torch
import transformers
from engine_throughput import MODELS, ensure_model
from local_mesh import LocalMesh, log


def baton_beams(client: httpx.Client, mesh: LocalMesh, prompt: list[int], width: int, max_tokens: int
                ) -> list[list[int]]:
    body = {"model": mesh.model_name, "prompt": prompt, "n": width, "max_tokens": max_tokens, "logprobs": 1,
            "use_beam_search": True, "ignore_eos": True, "return_tokens_as_token_ids": True}
    answer = client.post(f"http://{mesh.http}/v1/completions", json=body, timeout=600)
    answer.raise_for_status()
    return [[int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            for choice in answer.json()["choices"]]


def transformers_beams(model, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             max_new_tokens=max_tokens, do_sample=False, early_stopping="never", eos_token_id=None,
                             pad_token_id=0)
    return [row[len(prompt):].tolist() for row in out]


def timed(fn):
    start = time.perf_counter()
    made = fn()
    return time.perf_counter() - start, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="7m", choices=sorted(MODELS))
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_dir = ensure_model(args.model)
    rng = random.Random(0)
    vocab = MODELS[args.model]["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mesh = LocalMesh(model_dir)
    try:
        with httpx.Client() as client:
            baton_beams(client, mesh, prompts[0][:8], 2, 2)  # warm
            ours_s, theirs_s, same = [], [], 0
            for prompt in prompts:
                best_ours = best_theirs = float("inf")
                for _ in range(args.repeats):
                    seconds, ours = timed(lambda: baton_beams(client, mesh, prompt, args.width, args.max_tokens))
                    best_ours = min(best_ours, seconds)
                    seconds, theirs = timed(lambda: transformers_beams(hf, prompt, args.width, args.max_tokens))
                    best_theirs = min(best_theirs, seconds)
                same += ours == theirs
                ours_s.append(best_ours)
                theirs_s.append(best_theirs)
                log(f"prompt {len(ours_s)}: Baton {best_ours:.3f} s, transformers {best_theirs:.3f} s, "
                    f"same beams: {ours == theirs}")
    finally:
        mesh.stop()
    ratio = sum(theirs_s) / sum(ours_s)
    print(f"[{args.model}] {args.prompts} prompts of {args.prompt_len} tokens, {args.width} beams x "
          f"{args.max_tokens} tokens: Baton {sum(ours_s):.2f} s, transformers {sum(theirs_s):.2f} s; "
          f"ratio (transformers time / Baton time) {ratio:.2f}x; same beams on {same} of {args.prompts}")
    print(json.dumps({"model": args.model, "width": args.width, "max_tokens": args.max_tokens,
                      "prompts": args.prompts, "baton_seconds": round(sum(ours_s), 3),
                      "transformers_seconds": round(sum(theirs_s), 3), "beam_search_speed_ratio": round(ratio, 3),
                      "prompts_with_the_same_beams": same}))


if __name__ == "__main__":
    main()
