"""ShareGPT conversations as a bench workload, sampled as vLLM's benchmark samples them: each
conversation's first turn is a prompt and its second the reply, whose length in tokens (of the
model's tokenizer) is the request's output length; pairs with a prompt or reply under 4 tokens, a
prompt over 1024 or both over 2048 are left out. The prompt goes as its token ids (exact lengths) or
as its text (`--prompt-format text`, and chat).

Imports `tokenizers` only when called (`baton --help` stays fast).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadgen.workload import PromptFormat, RequestSpec

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


def read_conversations(path: str | Path) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation in a ShareGPT JSON file that has two."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: not a ShareGPT file (a JSON list of conversations)")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            prompt, reply = turns[0].get("value"), turns[1].get("value")
            if isinstance(prompt, str) and isinstance(reply, str):
                pairs.append((prompt, reply))
    return pairs


def load_tokenizer(path: str | Path):
    """A model directory's tokenizer.json (or the file itself)."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception for a missing or bad file
        raise ValueError(f"--tokenizer {path}: cannot read {file} ({e})") from None


def sharegpt_workload(pairs: list[tuple[str, str]], tokenizer, num_requests: int, prompt_format: PromptFormat,
                      rng: np.random.Generator) -> list[RequestSpec]:
    """`num_requests` pairs in a random order (the same generator state, the same requests);
    ValueError when fewer pass the length filters."""
    specs = []
    for index in rng.permutation(len(pairs)):
        prompt, reply = pairs[index]
        prompt_ids = tokenizer.encode(prompt).ids
        output_len = len(tokenizer.encode(reply, add_special_tokens=False).ids)
        prompt_len = len(prompt_ids)
        if (prompt_len < MIN_LEN or output_len < MIN_LEN or prompt_len > MAX_PROMPT_LEN
                or prompt_len + output_len > MAX_TOTAL_LEN):
            continue
        specs.append(RequestSpec(index=len(specs), prompt=prompt_ids if prompt_format == "ids" else prompt,
                                 prompt_len=prompt_len, output_len=output_len, prefix_id=None, prefix_len=0))
        if len(specs) == num_requests:
            return specs
    raise ValueError(f"the ShareGPT file has {len(specs)} conversations within the lengths vLLM samples "
                     f"(prompt and reply at least {MIN_LEN} tokens, prompt at most {MAX_PROMPT_LEN}, both at "
                     f"most {MAX_TOTAL_LEN}); {num_requests} asked for")
