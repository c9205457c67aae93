"""A decode engine whose pool lives in shared memory, fed by a prefill engine that
writes its pages through the shared-memory transport: the colocated tokens come out."""
from __future__ import annotations

import gc

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.kvstore.layout import PageLayout
from services.kvstore.page_copy import copy_pages
from services.kvstore.shared_memory import SharedKVPool

PARAMS = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
PROMPT = [(31 * j) % 1000 + 3 for j in range(53)]


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64)


def run(engine: LLMEngine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                tokens = out.token_ids
    return tokens


def test_prefill_writes_into_the_decode_engines_shared_pool(tiny_demo_model):
    colocated = LLMEngine(engine_config(tiny_demo_model))
    colocated.add_request("r", PROMPT, PARAMS)
    expected = run(colocated, "r")

    owned: list[SharedKVPool] = []

    def shared_tensor(shape, dtype, device):
        layout = PageLayout(num_layers=shape[0], num_kv_heads=shape[2], num_blocks=shape[3], block_size=shape[4],
                            head_dim=shape[5], dtype=str(dtype).removeprefix("torch."), fingerprint=b"test")
        owned.append(SharedKVPool.create(layout))
        return owned[0].tensor

    decode = LLMEngine(engine_config(tiny_demo_model), kv_tensor_factory=shared_tensor)
    pool = owned[0]
    prefill = LLMEngine(engine_config(tiny_demo_model))
    prefill.add_request("r", PROMPT, PARAMS, prefill_only=True)
    first = run(prefill, "r")
    dst = decode.reserve("r", len(PROMPT))

    target = SharedKVPool.attach(pool.name, pool.layout)  # what a prefill process does
    copied = copy_pages(prefill.runner.kv_pool.tensor, prefill.held_block_ids("r"), target.tensor, dst)
    assert copied == len(dst) * pool.layout.block_nbytes
    target.close()
    prefill.release("r")

    decode.add_prefilled_request("r", PROMPT, first[0], PARAMS)
    assert run(decode, "r") == expected
    decode.block_manager.check_integrity()
    del decode
    gc.collect()
    pool.close()
