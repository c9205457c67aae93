"""Speculative decoding with a draft model against plain decoding, on the same engine and prompts.

    .venv/bin/python bench/draft_model.py [--model 160m|7m] [--drafts 3] [--repeats 2]

No real model family lies on these machines, so the drafts come from the target itself, greedy,
batch 1 and batch 8, on random 128-token prompts:
- `first_layer`: the target cut to its first layer (its embeddings, final norm and head kept),
  the small model of a family as layer-skipping makes one; on random weights it agrees with the
  whole model far less often than a real family's small model agrees with its large one, so the
  figure is near the floor of what drafts cost;
- `self`: the target as its own draft: every draft is right (the ceiling of tokens a step), at a
  draft cost as high as the target's, so the figure shows the machinery's cost at full acceptance.
Each is decoded plainly and with drafts, alternating, best of `--repeats`; the tokens must be
identical (the engine makes the same ones either way), and the figure is the ratio of output
tokens/s, drafts over plain, printed beside the acceptance rate. The last line is one JSON object.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from engine_throughput import ensure_model
from speculative_decoding import bench_args, compare_on_random_prompts, vocab_size

from engine.speculative import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.draft_models import first_layers_copy  # noqa: E402


def first_layer_draft(model_dir: Path) -> Path:
    """The target cut to its first layer (made once, beside it)."""
    target = model_dir.with_name(model_dir.name + "-first-layer")
    if not (target / "model.safetensors").is_file():
        first_layers_copy(model_dir, target, 1)
    return target


def main() -> None:
    args = bench_args(__doc__, drafts=3)
    model_dir = ensure_model(args.model)
    vocab = vocab_size(model_dir)
    figures: dict[str, float] = {}
    for name, draft_dir in (("first_layer", first_layer_draft(model_dir)), ("self", model_dir)):
        speculative = SpeculativeConfig(num_speculative_tokens=args.drafts, method="draft_model",
                                        model=str(draft_dir))
        figures.update(compare_on_random_prompts(name, model_dir, vocab, speculative, args.repeats,
                                                 prefix="draft_model"))
    print(json.dumps({"model": args.model, "num_speculative_tokens": args.drafts, **figures}))


if __name__ == "__main__":
    main()
