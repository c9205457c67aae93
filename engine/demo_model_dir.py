"""Where the demo model lives and whether it is all there: without torch, so that `baton up` finds a
made demo model without the second of CPU that importing engine/demo_model.py (its maker) costs."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DEMO_MODEL_DIR = Path("~/.cache/baton/demo-model")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json")


def default_demo_model_dir() -> Path:
    """Where `ensure_demo_model` keeps the demo model: $BATON_DEMO_MODEL, else ~/.cache/baton/demo-model."""
    return Path(os.environ.get("BATON_DEMO_MODEL") or DEFAULT_DEMO_MODEL_DIR).expanduser()


def is_demo_model_dir(path: str | os.PathLike) -> bool:
    return all((Path(path) / name).is_file() for name in REQUIRED_FILES)
