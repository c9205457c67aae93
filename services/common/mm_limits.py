"""vLLM's --limit-mm-per-prompt: how many images a prompt may hold (the gateway refuses more), 0 making a
multimodal model text-only (its workers then load no image encoder; with --enable-mm-embeds, images still come as
their encoder's rows); vLLM's --enable-mm-embeds; and vLLM's --mm-processor-kwargs: the image processor's
settings a gateway reads images by, over the model's."""
from __future__ import annotations

import argparse

from services.common.settings import ConfigError, json_object

MODALITIES = ("image", "video", "audio")  # vLLM's names; only images are served here


def add_limit_mm_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit-mm-per-prompt", metavar="JSON", default="",
                        help="the most images a prompt may hold, as vLLM's flag: '{\"image\": N}'; 0 serves a "
                             "multimodal model's text only, without loading its image encoder (default: no limit)")


def add_mm_embeds_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-mm-embeds", action="store_true",
                        help="images may come as their encoder's rows (chat's image_embeds parts, as vLLM's flag: "
                             "Gemma 3's, Qwen2-VL's and Qwen2.5-VL's); with --limit-mm-per-prompt '{\"image\": 0}' "
                             "only so, the workers loading no image encoder")


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


# What --mm-processor-kwargs may set: Qwen-VL's pixel bounds, any processor's size (Pixtral's longest_edge), Gemma
# 3's pan-and-scan (a switch, and the rest positive integers but its ratio, a positive number), and Llama 4's tiles
# (max_patches, and the switch resize_to_max_canvas).
PROCESSOR_KWARGS = ("min_pixels", "max_pixels", "size", "do_pan_and_scan", "pan_and_scan_min_crop_size",
                    "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate", "max_patches",
                    "resize_to_max_canvas")
SWITCHES, NUMBERS = ("do_pan_and_scan", "resize_to_max_canvas"), ("pan_and_scan_min_ratio_to_activate",)


def add_mm_processor_kwargs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mm-processor-kwargs", metavar="JSON", default="",
                        help="the image processor's settings over the model's, as vLLM's flag: Qwen-VL's "
                             "'{\"max_pixels\": N}' (and min_pixels) bounds an image's tokens, '{\"size\": "
                             "{\"longest_edge\": N}}' Pixtral's, '{\"do_pan_and_scan\": true}' has Gemma 3 read "
                             "crops of an image far from square beside it")


def processor_kwargs(text: str) -> dict:
    """--mm-processor-kwargs' settings ({} when not given); ConfigError for one not served here, or a value that
    is not a positive integer (or, for size, an object of them)."""
    try:
        return checked_processor_kwargs(json_object(text, "--mm-processor-kwargs") or {}, "--mm-processor-kwargs")
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def checked_processor_kwargs(kwargs: dict, source: str) -> dict:
    """`kwargs` (the flag's, or a request's mm_processor_kwargs) as they are; ValueError naming `source` for a
    setting not served here, or a value not of its kind: a positive integer (or, for size, an object of them)."""
    for key, value in kwargs.items():
        if key not in PROCESSOR_KWARGS:
            raise ValueError(f"{source}: {key!r} is not served here (only {', '.join(PROCESSOR_KWARGS)})")
        if key in SWITCHES:
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
            continue
        if key in NUMBERS:
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{source}: {key} must be a positive number, got {value!r}")
            continue
        values = list(value.values()) if key == "size" and isinstance(value, dict) else [value]
        if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
            raise ValueError(f"{source}: {key} must be a positive integer"
                             f"{' or an object of them' if key == 'size' else ''}, got {value!r}")
    return kwargs
