"""Tests' CUDA variants: skipped where torch sees no CUDA device (CI has none); scripts/gpu-checks.sh
runs them on a machine with one (every test id with "cuda" in it)."""
from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device; torch.cuda.is_available() is False here")
# An engine_options parameter of a test that builds its engines from such a dict.
ON_CUDA = pytest.param({"device": "cuda"}, id="cuda", marks=needs_cuda)
DEVICES = ["cpu", pytest.param("cuda", id="cuda", marks=needs_cuda)]
