"""Gemma 3's pan-and-scan (transformers' Gemma3ImageProcessor with do_pan_and_scan, vLLM's mm_processor_kwargs
of that name): an image far from square also goes to the model as crops along its longer side, each resized to
the tower's size as the whole image is, so that a wide screenshot or a tall receipt is read at more than the
tower's 896 pixels across."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

# The processor's settings (preprocessor_config.json's, a request's mm_processor_kwargs) by our names for them.
FIELDS = {"do_pan_and_scan": "enabled", "pan_and_scan_min_crop_size": "min_crop_size",
          "pan_and_scan_max_num_crops": "max_num_crops",
          "pan_and_scan_min_ratio_to_activate": "min_ratio_to_activate"}
KWARGS = tuple(FIELDS)


@dataclass(frozen=True)
class PanAndScan:
    """Off by default, and transformers' processor's defaults (Gemma3Processor's images_kwargs) where no setting
    gives them."""

    enabled: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def with_kwargs(self, settings: Mapping[str, Any]) -> PanAndScan:
        """These settings with those of `settings` (by transformers' names) over them, a null one left as it is."""
        changes = {field: settings[key] for key, field in FIELDS.items() if settings.get(key) is not None}
        return replace(self, **changes) if changes else self

    def crop_boxes(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """The crops of an image of that size, as (left, top, right, bottom) boxes in the processor's order (row by
        row): none where it is off, where the image is near enough square, or where a crop would be under the
        minimum size; else as many as its aspect ratio rounds to, along its longer side (at least 2, at most
        max_num_crops, none narrower than min_crop_size), the last cut short at the image's edge."""
        if not self.enabled:
            return []
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio_to_activate:
            return []
        along = min(math.floor(long / short + 0.5), math.floor(long / self.min_crop_size))
        along = min(self.max_num_crops, max(2, along))
        num_w, num_h = (along, 1) if width >= height else (1, along)
        crop_w, crop_h = math.ceil(width / num_w), math.ceil(height / num_h)
        if min(crop_w, crop_h) < self.min_crop_size:
            return []
        return [(left, top, min(left + crop_w, width), min(top + crop_h, height))
                for top in range(0, num_h * crop_h, crop_h) for left in range(0, num_w * crop_w, crop_w)]
