"""When each request is sent: a Poisson process, or gamma-distributed gaps for burstier
(or smoother) traffic, as vLLM's benchmark draws them.

Gaps are Gamma(shape=b, scale=1/(rate*b)): the mean gap is 1/rate whatever b is, and
b = 1 is the exponential (Poisson arrivals); b < 1 clumps requests, b > 1 evens them out.
"""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start of the run at which each request is sent, non-decreasing,
    the first at 0. An infinite rate sends everything at once."""
    if num_requests < 1:
        raise ValueError(f"the number of requests must be at least 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"the request rate must be above 0, got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"the burstiness must be a finite number above 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
