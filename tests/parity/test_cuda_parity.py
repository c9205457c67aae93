"""The engine on a CUDA device against `transformers` on the CPU, on the same weights: every tiny
architecture's logits, and its greedy tokens in a chunked batch with a shared prefix (the checks of
test_transformers_parity.py, with the engine's `device` set). Skipped where torch sees no CUDA device."""
from __future__ import annotations

import pytest
import torch

from tests.parity.conftest import TINY_MODELS
from tests.parity.test_transformers_parity import _check_greedy, _check_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the engine on a CUDA device needs one; torch.cuda.is_available() is False here")


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_logits_on_cuda_match_transformers(tiny_model_dirs, name):
    _check_logits(tiny_model_dirs[name], max_num_batched_tokens=32, device="cuda")


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_batch_on_cuda_matches_transformers(tiny_model_dirs, name):
    _check_greedy(tiny_model_dirs[name], max_num_batched_tokens=32, device="cuda")
