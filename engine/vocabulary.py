"""The model's vocabulary as its tokenizer.json spells it: the tokenizer, where the model has one,
and the ids of tokens named by their text (a classifier's labels)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def vocabulary_ids(tokens: tuple[str, ...], tokenizer: Tokenizer | None) -> list[int]:
    """Each of `tokens`' id in the model's vocabulary; ValueError for one it lacks."""
    ids = [tokenizer.token_to_id(t) if tokenizer is not None else None for t in tokens]
    missing = [t for t, i in zip(tokens, ids) if i is None]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} are not tokens of the model's tokenizer.json")
    return ids
