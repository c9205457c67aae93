"""Speculative decoding with EAGLE heads against plain decoding, on the same engine and prompts.

    .venv/bin/python bench/eagle.py [--model 160m|7m] [--drafts 3] [--repeats 2]

No trained EAGLE head lies on these machines, so the heads are made from the target (tests/draft_models.py):
- `replica`: an EAGLE-1 head computing the target (the target's embeddings scaled to an RMS of 1 and two norms
  made ones, in the target too: plain and drafted decoding both run that target). It agrees with the target
  but where the target attends to the prompt's first token, which an EAGLE head never reads: the ceiling of
  acceptance, at a draft as costly as the target (all its layers);
- `eagle3_random`: an EAGLE-3 head of random weights, one layer over three target layers' inputs and a draft
  vocabulary of a quarter of the target's: almost no draft right, so the figure is what drafting costs when it
  buys nothing (the head's layer, `fc`, and the hidden states the target hands over).
A trained head, one layer and mostly right, sits above both. Each is decoded plainly and with drafts,
alternating, best of `--repeats`, greedy, batch 1 and 8, on random 128-token prompts; the tokens must be
identical, and the figure is the ratio of output tokens/s, drafts over plain, beside the acceptance rate.
The last line is one JSON object.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from engine_throughput import MODELS, ensure_model
from speculative_decoding import bench_args, compare_on_random_prompts, vocab_size

from engine.speculative import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.draft_models import eagle_head, eagle_replica  # noqa: E402


def heads(model_name: str, model_dir: Path) -> dict[str, tuple[Path, str, Path]]:
    """Each head's target, method and directory (made once, beside the model)."""
    target = model_dir.with_name(model_dir.name + "-eagle-target")
    replica = model_dir.with_name(model_dir.name + "-eagle-replica")
    if not (replica / "model.safetensors").is_file():
        for made in (target, replica):
            shutil.rmtree(made, ignore_errors=True)
        eagle_replica(model_dir, target, replica)
    random_head = model_dir.with_name(model_dir.name + "-eagle3-random")
    if not (random_head / "model.safetensors").is_file():
        layers, vocab = MODELS[model_name]["num_layers"], MODELS[model_name]["vocab_size"]
        eagle_head(model_dir, random_head, "eagle3", draft_vocab_size=vocab // 4,
                   target_layers=[1, layers // 2, layers - 1])
    return {"replica": (target, "eagle", replica), "eagle3_random": (model_dir, "eagle3", random_head)}


def main() -> None:
    args = bench_args(__doc__, drafts=3)
    model_dir = ensure_model(args.model)
    vocab = vocab_size(model_dir)
    figures: dict[str, float] = {}
    for name, (target, method, head) in heads(args.model, model_dir).items():
        speculative = SpeculativeConfig(num_speculative_tokens=args.drafts, method=method, model=str(head))
        figures.update(compare_on_random_prompts(name, target, vocab, speculative, args.repeats, prefix="eagle"))
    print(json.dumps({"model": args.model, "num_speculative_tokens": args.drafts, **figures}))


if __name__ == "__main__":
    main()
