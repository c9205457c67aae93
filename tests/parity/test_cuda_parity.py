"""The engine on a CUDA device against `transformers` on the CPU, on the same weights: every tiny
architecture's logits, and its greedy tokens in a chunked batch with a shared prefix (the checks of
test_transformers_parity.py, with the engine's `device` set), and LoRA adapters' logits (as in
test_lora.py). Skipped where torch sees no CUDA device."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.cuda import needs_cuda
from tests.parity.conftest import TINY_MODELS
from tests.parity.test_lora import served  # noqa: F401  (the adapters, a fixture)
from tests.parity.test_transformers_parity import _check_greedy, _check_logits, _prefill_logits, _random_prompt

pytestmark = needs_cuda


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_logits_on_cuda_match_transformers(tiny_model_dirs, name):
    _check_logits(tiny_model_dirs[name], max_num_batched_tokens=32, device="cuda")


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_batch_on_cuda_matches_transformers(tiny_model_dirs, name):
    _check_greedy(tiny_model_dirs[name], max_num_batched_tokens=32, device="cuda")


@pytest.fixture(scope="module")
def served_on_cuda(served, tiny_model_dirs):  # noqa: F811
    _, merged, root = served
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama-gqa-untied"]), dtype="float32", device="cuda",
                                    num_kv_blocks=256, max_num_batched_tokens=64,
                                    lora_modules=(("tuned", str(root / "tuned")), ("qv", str(root / "qv")))))
    return engine, merged


@pytest.mark.parametrize("lora_name", [None, "tuned", "qv"])
def test_adapters_on_cuda_give_transformers_logits_with_their_deltas_merged(served_on_cuda, lora_name):
    engine, merged = served_on_cuda
    for n in (1, 17, 100):  # 100: chunked by the budget of 64
        prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
        with torch.no_grad():
            ref = merged[lora_name](torch.tensor([prompt])).logits[0, -1]
        diff = (_prefill_logits(engine, prompt, lora_name) - ref).abs().max().item()
        assert diff < 1e-4, f"adapter {lora_name}: prompt of {n} tokens, max |logit diff| {diff}"
