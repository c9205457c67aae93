"""vLLM's --tokenizer: the model's tokenizer read from a directory of its own (`--tokenizer-dir`), for a
checkpoint saved without one. Every service that reads the tokenizer takes it, from one shared variable:
the gateway and the tokenizer service encode and render conversations by it, the workers stop and guide
generation by it, and two that read different tokenizers would disagree on every prompt."""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from services.common.settings import ConfigError

ENV_TOKENIZER_DIR = "BATON_TOKENIZER_DIR"


def add_tokenizer_dir_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--tokenizer-dir", metavar="DIR", default=env.get(ENV_TOKENIZER_DIR) or None,
                        help=f"the directory of the model's tokenizer (tokenizer.json, tokenizer_config.json, its "
                             f"chat templates) where the model's own has none, as vLLM's --tokenizer "
                             f"(${ENV_TOKENIZER_DIR}); give every service the same one")


def tokenizer_dir(value: str | Path | None) -> Path | None:
    """`--tokenizer-dir`, resolved; ConfigError for a directory without a tokenizer.json."""
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"--tokenizer-dir {value}: no tokenizer.json there (${ENV_TOKENIZER_DIR})")
    return path
