"""vLLM's --limit-mm-per-prompt: how many images a prompt may hold (the gateway refuses more), 0 making a
multimodal model text-only (its workers then load no image encoder)."""
from __future__ import annotations

import argparse

from services.common.settings import ConfigError, json_object

MODALITIES = ("image", "video", "audio")  # vLLM's names; only images are served here


def add_limit_mm_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit-mm-per-prompt", metavar="JSON", default="",
                        help="the most images a prompt may hold, as vLLM's flag: '{\"image\": N}'; 0 serves a "
                             "multimodal model's text only, without loading its image encoder (default: no limit)")


def image_limit(text: str) -> int | None:
    """The images a prompt may hold by `text` (the flag's JSON); None for no limit. ConfigError for JSON that
    is not an object of modalities to counts, or a count of video or audio, which are not served."""
    limits = json_object(text, "--limit-mm-per-prompt")
    if limits is None:
        return None
    if any(k not in MODALITIES or not isinstance(v, int) or isinstance(v, bool) or v < 0 for k, v in limits.items()):
        raise ConfigError(f"--limit-mm-per-prompt maps {', '.join(MODALITIES)} to counts of at least 0, got {text}")
    if any(limits.get(kind) for kind in ("video", "audio")):
        raise ConfigError("--limit-mm-per-prompt: videos and audio are not served here, only images")
    return limits.get("image")
