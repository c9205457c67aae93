"""Models whose pages are not Llama's through the mesh: DeepSeek-V3's (multi-head latent attention: its pages
hold the latent rows, not per-head k and v; V3.2's its indexer's keys beside them), Gemma 4's (heads of two sizes,
the wider over several of the pages' heads; no pages for the layers sharing an earlier layer's KV) and the hybrids'
(Qwen3.5's Gated DeltaNet, Granite 4.0-H's and Nemotron-H's Mamba-2, LFM2's convolutions: pages for their attention
layers only, and a request's recurrent states in pages of their own after its tokens'). The pages a prefill worker
computes are handed to the decode worker over shared memory or the gRPC stream, and what it decodes from them equals
`transformers.generate`."""
from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch

from engine.kv_pool import num_state_blocks
from engine.model_config_loader import load_model_config
from tests.parity.conftest import make_tiny_model
from tests.services.gateway.mesh import BLOCK_SIZE, WHOLE_POOL_TOKENS, start_mesh, stop_mesh
from tests.services.gateway.test_conditional_disaggregation import prefills_by_place

transformers = pytest.importorskip("transformers")
MAX_TOKENS = 12
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module", params=["deepseek-v3-q-proj", "deepseek-v3.2", "gemma4-e", "qwen3.5", "granite4-h",
                                        "nemotron-h", "lfm2"])
def paged_model(request, tiny_demo_model, tmp_path_factory):
    # DeepSeek's cache rows are of odd width (8 + 23): padded in the pages, and so in every transfer.
    model_dir = make_tiny_model(tmp_path_factory.mktemp("pages") / request.param, request.param)
    # The demo model's tokenizer: its vocabulary covers every id of the tiny model's (512).
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_demo_model / name, model_dir / name)
    # A context that holds the mesh's probe of a whole decode pool (no RoPE scaling reads it).
    config = json.loads((model_dir / "config.json").read_text())
    assert config.get("rope_scaling") is None
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return model_dir


def transformers_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        made = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(made[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("transport", ["shared-memory", "grpc-stream"])
def test_a_decode_worker_decodes_from_the_pages_prefill_handed_over(paged_model, transport):
    short, long = [3 + (i * 11) % 500 for i in range(20)], [3 + (i * 7) % 500 for i in range(300)]
    expected = transformers_greedy(paged_model, [short, long])
    # Short prompts prefill on their decode worker (no handoff), long ones on the prefill worker.
    mesh = start_mesh(paged_model, num_prefill=1, num_decode=1,
                      gateway_args=("--kv-transport", transport, "--local-prefill-max-tokens", "100"))
    try:
        with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            for prompt, tokens in zip((short, long), expected):
                answer = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, logprobs=0,
                                                   extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
                made = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
                assert made == tokens, len(prompt)
        assert prefills_by_place(mesh.gateway) == {"decode": 1.0, "prefill": 1.0}
        # A reservation adds a hybrid model's pages of the request's recurrent states.
        num_states = num_state_blocks(load_model_config(paged_model), BLOCK_SIZE, torch.float32)
        mesh.assert_decode_pools_free(num_tokens=WHOLE_POOL_TOKENS - num_states * BLOCK_SIZE)
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())
