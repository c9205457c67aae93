"""vLLM's --limit-mm-per-prompt: how many images and videos a prompt may hold (the gateway refuses more), 0 images
making a multimodal model text-only (its workers then load no image encoder, which its videos need too; with
--enable-mm-embeds, images still come as their encoder's rows); vLLM's --enable-mm-embeds; and vLLM's
--mm-processor-kwargs: the image processor's settings a gateway reads images by, over the model's."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from services.common.settings import ConfigError, json_object

MODALITIES = ("image", "video", "audio")  # vLLM's names; images and videos are served here


def add_limit_mm_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit-mm-per-prompt", metavar="JSON", default="",
                        help="the most images and videos a prompt may hold, as vLLM's flag: '{\"image\": N, "
                             "\"video\": M}'; 0 images serves a multimodal model's text only, without loading its "
                             "image encoder (default: no limit)")


def add_mm_embeds_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-mm-embeds", action="store_true",
                        help="images may come as their encoder's rows (chat's image_embeds parts, as vLLM's flag: "
                             "Gemma 3's, Qwen2-VL's and Qwen2.5-VL's); with --limit-mm-per-prompt '{\"image\": 0}' "
                             "only so, the workers loading no image encoder")


def image_limit(text: str) -> int | None:
    """The images a prompt may hold by `text` (the flag's JSON); None for no limit. ConfigError for JSON that
    is not an object of modalities to counts, a count of audio, which is not served, or of videos beside no
    images (no image encoder)."""
    return _limits(text).get("image")


def video_limit(text: str) -> int | None:
    """The videos a prompt may hold by `text`; None for no limit, 0 where images are limited to 0."""
    limits = _limits(text)
    return 0 if limits.get("image") == 0 else limits.get("video")


def _limits(text: str) -> dict:
    limits = json_object(text, "--limit-mm-per-prompt")
    if limits is None:
        return {}
    if any(k not in MODALITIES or not isinstance(v, int) or isinstance(v, bool) or v < 0 for k, v in limits.items()):
        raise ConfigError(f"--limit-mm-per-prompt maps {', '.join(MODALITIES)} to counts of at least 0, got {text}")
    if limits.get("audio"):
        raise ConfigError("--limit-mm-per-prompt: audio is not served here, only images and videos")
    if limits.get("image") == 0 and limits.get("video"):
        raise ConfigError("--limit-mm-per-prompt: videos are encoded by the image encoder, which 0 images leaves "
                          "unloaded: give videos 0 too, or images more")
    return limits


# What --mm-processor-kwargs may set: Qwen-VL's pixel bounds, any processor's size (Pixtral's longest_edge), Gemma
# 3's pan-and-scan (a switch, and the rest positive integers but its ratio, a positive number), Llama 4's tiles
# (max_patches, and the switch resize_to_max_canvas), Gemma 4's budget of tokens an image (max_soft_tokens), Step-3.7's
# longest side an image is scaled down to before it is cut (max_image_size), and Qwen-VL's video processor's sampling
# (VIDEO_KWARGS).
VIDEO_KWARGS = ("fps", "do_sample_frames")
PROCESSOR_KWARGS = ("min_pixels", "max_pixels", "size", "do_pan_and_scan", "pan_and_scan_min_crop_size",
                    "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate", "max_patches",
                    "resize_to_max_canvas", "max_soft_tokens", "max_image_size", *VIDEO_KWARGS)
SWITCHES = ("do_pan_and_scan", "resize_to_max_canvas", "do_sample_frames")
NUMBERS = ("pan_and_scan_min_ratio_to_activate", "fps")


def add_mm_processor_kwargs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mm-processor-kwargs", metavar="JSON", default="",
                        help="the image processor's settings over the model's, as vLLM's flag: Qwen-VL's "
                             "'{\"max_pixels\": N}' (and min_pixels) bounds an image's tokens, '{\"size\": "
                             "{\"longest_edge\": N}}' Pixtral's, '{\"do_pan_and_scan\": true}' has Gemma 3 read "
                             "crops of an image far from square beside it, '{\"max_soft_tokens\": N}' sets Gemma 4's "
                             "tokens an image, '{\"max_image_size\": N}' Step-3.7's longest side before it is cut, "
                             "'{\"fps\": N}' samples Qwen-VL's videos at N frames a second")


def add_media_io_kwargs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--media-io-kwargs", metavar="JSON", default="",
                        help="how media are read, as vLLM's flag: '{\"video\": {\"num_frames\": N}}' samples N "
                             "frames of a video, evenly (-1: every frame; default: Qwen's 2 a second, as vLLM "
                             "samples them); '{\"image\": {\"rgba_background_color\": [R, G, B]}}' what an "
                             "image's transparency shows (default white); a request's media_io_kwargs over them")


# What --media-io-kwargs (and a request's media_io_kwargs) may set, by modality.
MEDIA_IO_KWARGS = {"video": ("num_frames",), "image": ("rgba_background_color",)}


def media_io_kwargs(text: str) -> dict:
    """--media-io-kwargs' settings ({} when not given), as `checked_media_io_kwargs` gives them; ConfigError for
    one not served here."""
    return _flag_kwargs(text, "--media-io-kwargs", checked_media_io_kwargs)


def checked_media_io_kwargs(kwargs: dict, source: str) -> dict:
    """`kwargs` (the flag's, or a request's media_io_kwargs), an image's background color as a tuple; ValueError
    naming `source` for a modality or setting not served here, or a value not of its kind: a video's num_frames a
    positive integer or -1 (every frame), an image's rgba_background_color three integers in [0, 255]."""
    checked: dict = {}
    for modality, settings in kwargs.items():
        if modality not in MEDIA_IO_KWARGS or not isinstance(settings, dict) or \
                set(settings) - set(MEDIA_IO_KWARGS[modality]):
            raise ValueError(f"{source}: only {json.dumps({m: dict.fromkeys(k) for m, k in MEDIA_IO_KWARGS.items()})}"
                             f" are served here, got {json.dumps(kwargs)}")
        frames = settings.get("num_frames")
        if frames is not None and (type(frames) is not int or not (frames > 0 or frames == -1)):  # bool is no int
            raise ValueError(f"{source}: video's num_frames must be a positive integer or -1 (every frame), "
                             f"got {frames!r}")
        color = settings.get("rgba_background_color")
        if color is not None and (not isinstance(color, list | tuple) or len(color) != 3 or
                                  any(type(c) is not int or not 0 <= c <= 255 for c in color)):
            raise ValueError(f"{source}: image's rgba_background_color must be three integers in [0, 255], "
                             f"got {color!r}")
        checked[modality] = {**settings, **({"rgba_background_color": tuple(color)} if color is not None else {})}
    return checked


def processor_kwargs(text: str) -> dict:
    """--mm-processor-kwargs' settings ({} when not given); ConfigError for one not served here, or a value that
    is not a positive integer (or, for size, an object of them)."""
    return _flag_kwargs(text, "--mm-processor-kwargs", checked_processor_kwargs)


def _flag_kwargs(text: str, flag: str, checked: Callable[[dict, str], dict]) -> dict:
    """A flag's JSON object of settings, `checked`; ConfigError for JSON that is not one, or a setting refused."""
    try:
        return checked(json_object(text, flag) or {}, flag)
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
