"""Llama 4's image processor (transformers' Llama4ImageProcessor): an image resized, its aspect kept, into the
canvas of square tiles (at most max_patches of them) that fits it best, padded with black to fill it, each tile
read by the tower as an image of its own; an image of more than one tile goes with a global tile, the whole image
squeezed to one tile's size. Resized as torchvision resizes a uint8 tensor (antialiased bilinear), which is not
PIL's resampling: torch is imported only by a gateway serving Llama 4's images."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from PIL import Image

from services.gateway.torchvision_resize import torchvision_resized

MOST_TILES = 256  # a request's max_patches at most (Llama 4's processor's default is 16)


@dataclass(frozen=True)
class TileCanvas:
    tile_size: int  # a tile's side in pixels (the processor's size)
    max_tiles: int  # max_patches
    # Resize to the largest canvas the image fits without distortion, not the smallest it fits (upscaling a
    # small image no further than one tile's side).
    resize_to_max_canvas: bool = False

    @cached_property
    def canvases(self) -> list[tuple[int, int]]:
        """Every canvas (height, width) of at most max_tiles tiles, in the processor's order (which breaks ties):
        by tile count from the most down, by aspect ratio as first seen, each aspect's canvases in turn."""
        by_ratio: dict[float, list[tuple[int, int]]] = {}
        for count in range(self.max_tiles, 0, -1):
            for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
                by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
        return [(rows * self.tile_size, cols * self.tile_size) for grid in by_ratio.values() for rows, cols in grid]

    def canvas_of(self, height: int, width: int) -> tuple[int, int]:
        """The canvas an image of that size goes into: the one it needs the least upscaling to fill a side of
        (none where one needs some; else the one it needs the least downscaling for, or the most upscaling with
        resize_to_max_canvas), the smallest of those that need the same. Scales in float32, as the processor's."""
        canvases = np.array(self.canvases, dtype=np.int64)
        scales = np.minimum(canvases[:, 0].astype(np.float32) / np.float32(height),
                            canvases[:, 1].astype(np.float32) / np.float32(width))
        upscaling = scales[scales >= 1]
        if len(upscaling):
            chosen = upscaling.max() if self.resize_to_max_canvas else upscaling.min()
        else:
            chosen = scales[scales < 1].max()
        fitting = canvases[scales == chosen]
        best = fitting[np.argmin(fitting[:, 0] * fitting[:, 1])]
        return int(best[0]), int(best[1])

    def resized_size(self, height: int, width: int, canvas: tuple[int, int]) -> tuple[int, int]:
        """(height, width) the image is resized to in `canvas`: the most of it its aspect ratio allows, but never
        upscaled past one tile's side unless resize_to_max_canvas."""
        target_height, target_width = canvas
        if not self.resize_to_max_canvas:
            target_height = min(max(height, self.tile_size), target_height)
            target_width = min(max(width, self.tile_size), target_width)
        scale_w, scale_h = target_width / width, target_height / height
        if scale_w < scale_h:
            new_height, new_width = min(math.floor(height * scale_w), target_height), target_width
        else:
            new_height, new_width = target_height, min(math.floor(width * scale_h), target_width)
        return max(new_height, 1), max(new_width, 1)

    def tiled(self, image: Image.Image, canvas: tuple[int, int] | None = None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """`image` (RGB) as the canvas of tiles, uint8 [canvas height, canvas width, 3], and its global tile
        (uint8 [tile, tile, 3]) where the canvas has more than one tile, else None. `canvas`: its `canvas_of`, where
        the caller has it already."""
        import torch  # noqa: PLC0415 (the gateway of another model never loads it)

        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]  # [1, 3, H, W] uint8, channels last
        canvas = canvas or self.canvas_of(image.height, image.width)
        height, width = self.resized_size(image.height, image.width, canvas)
        whole = torch.zeros(canvas[0], canvas[1], 3, dtype=torch.uint8)  # the padding black, as the processor's
        whole[:height, :width] = torchvision_resized(torch, pixels, height, width)
        if canvas == (self.tile_size, self.tile_size):
            return whole.numpy(), None
        return whole.numpy(), torchvision_resized(torch, pixels, self.tile_size, self.tile_size).numpy()

