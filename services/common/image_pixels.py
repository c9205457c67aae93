"""An image's pixels as a model's image processor normalizes them, from its resized RGB: rescaled in
float64 and cast to float32, less the mean, over the standard deviation, channels first, as transformers'
image processors compute them (numpy; the engine's ImageInput.pixels computes the same in torch)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def normalized(rgb: np.ndarray, rescale_factor: float, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """`rgb` (uint8 [height, width, channels]) as float32 [channels, height, width]."""
    rescaled = (rgb.astype(np.float64) * rescale_factor).astype(np.float32)
    result = (rescaled - np.array(mean, dtype=np.float32)) / np.array(std, dtype=np.float32)
    return np.ascontiguousarray(result.transpose(2, 0, 1))
