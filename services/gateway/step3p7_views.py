"""Step-3.7's image processor (transformers' Step3p7ImageProcessor): an image's global view, squeezed to one square of
the processor's size, and local crops of it where it is larger than that square or far from square: the image resized
to a grid of windows (a window's side fitted to its aspect, each side snapped to whole windows) and each window
squeezed to a square of patch_size. Resized as torchvision resizes a uint8 tensor (torchvision_resize.py): torch is
imported only by a gateway serving Step-3.7's images."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from services.gateway.torchvision_resize import torchvision_resized


@dataclass(frozen=True)
class CropPlan:
    """How an image of some size is cut: its size once normalized (squared where far from square and tiny, scaled
    down where larger than max_image_size), the size the crops are cut from, a window's side (0: no crops) and the
    grid of them."""

    width: int
    height: int
    crop_width: int
    crop_height: int
    window: int
    columns: int
    rows: int
    square_padded: bool


@dataclass(frozen=True)
class LocalCrops:
    size: int = 728  # the global view's side (the processor's size)
    patch_size: int = 504  # a local crop's side
    max_image_size: int = 3024  # an image's longest side, once scaled down

    def plan(self, height: int, width: int) -> CropPlan:
        """The processor's `_plan_patches` for an image of this size."""
        padded = min(width, height) < 32 and max(width / height, height / width) > 4
        if padded:
            width = height = max(width, height)
        if max(height, width) > self.max_image_size:
            scale = self.max_image_size / max(height, width)
            width, height = int(width * scale), int(height * scale)
        short, long = min(height, width), max(height, width)
        if long <= self.size:
            window = short if long / short > 1.5 else 0
        elif long / short > 4:
            window = min(short, self.patch_size)
        else:
            window = self.patch_size
        if window == 0:
            return CropPlan(width, height, width, height, 0, 0, 0, padded)
        crop_width, crop_height = (window * (side // window + (side % window > 0.2 * window)) if side >= window
                                   else side for side in (width, height))
        return CropPlan(width, height, crop_width, crop_height, window, max(1, crop_width // window),
                        max(1, crop_height // window), padded)

    def views(self, image: Image.Image) -> tuple[list[np.ndarray], np.ndarray, int]:
        """`image` (RGB) as the processor cuts it: its local crops row by row (uint8 [patch_size, patch_size, 3]
        each), its global view (uint8 [size, size, 3]) and the crops a row (0 where it has none)."""
        import torch  # noqa: PLC0415 (the gateway of another model never loads it)

        plan = self.plan(image.height, image.width)
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]  # [1, 3, H, W] uint8
        if plan.square_padded:  # with black below or to the right, as the processor pads
            side = max(image.height, image.width)
            square = torch.zeros(1, 3, side, side, dtype=torch.uint8)
            square[:, :, :image.height, :image.width] = pixels
            pixels = square
        scaled = torchvision_resized(torch, pixels, plan.height, plan.width).permute(2, 0, 1)[None]
        whole = torchvision_resized(torch, scaled, self.size, self.size).numpy()
        if not plan.window:
            return [], whole, 0
        cut = torchvision_resized(torch, pixels, plan.crop_height, plan.crop_width).permute(2, 0, 1)[None]
        crops = [torchvision_resized(torch, cut[:, :, top:top + plan.window, left:left + plan.window], self.patch_size,
                          self.patch_size).numpy()
                 for top in range(0, plan.crop_height, plan.window) for left in range(0, plan.crop_width, plan.window)]
        return crops, whole, plan.columns
