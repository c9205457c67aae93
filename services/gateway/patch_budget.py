"""Gemma 4's image processor's size: an image resized, its aspect kept, to the largest size within a budget of
patches whose sides are whole squares of pooling_kernel_size x pooling_kernel_size patches (each square one image
token), as transformers' Gemma4ImageProcessor resizes it (up or down)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

# The soft tokens an image may take, as Gemma4ImageProcessor allows them.
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class PatchBudget:
    patch_size: int
    pooling: int  # patches a token's square has on a side
    max_soft_tokens: int

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}, "
                             f"got {self.max_soft_tokens}")

    @property
    def square(self) -> int:
        """A token's square's side in pixels."""
        return self.patch_size * self.pooling

    def with_soft_tokens(self, max_soft_tokens: int) -> PatchBudget:
        return replace(self, max_soft_tokens=int(max_soft_tokens))

    def size_of(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of an image of that size once resized; ValueError for one no budget holds."""
        most_pixels = self.max_soft_tokens * self.pooling ** 2 * self.patch_size ** 2
        scale = math.sqrt(most_pixels / (height * width))
        step = self.square
        new_height, new_width = math.floor(scale * height / step) * step, math.floor(scale * width / step) * step
        if not new_height and not new_width:
            raise ValueError(f"an image of {width}x{height} pixels makes no {step}-pixel square")
        longest = self.max_soft_tokens * step  # a side of one row of squares, the budget's length
        if not new_height:  # far wider than high: one row of squares, as many as its aspect gives
            new_height, new_width = step, min(width // height * step, longest)
        elif not new_width:
            new_height, new_width = min(height // width * step, longest), step
        if new_height * new_width > most_pixels:
            raise ValueError(f"an image of {width}x{height} pixels resized to {new_width}x{new_height} takes more "
                             f"than {self.max_soft_tokens * self.pooling ** 2} patches")
        return new_height, new_width
