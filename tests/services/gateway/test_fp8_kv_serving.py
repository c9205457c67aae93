"""--kv-cache-dtype fp8 through the mesh: prefill and decode workers whose pages hold one byte a
number hand them over as any others (the layout names the dtype), and what is decoded from them
equals the in-process engine with the same cache, on both prefill paths."""
from __future__ import annotations

import openai

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.services.gateway.mesh import start_mesh, stop_mesh

MAX_TOKENS = 16


def _greedy(model_dir, prompt: list[int], **engine_options) -> tuple[list[int], list[float]]:
    """Tokens and each one's logprob, greedy, from an in-process engine."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128, **engine_options))
    engine.add_request("greedy", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                        logprobs=0))
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [record[token] for token, record in zip(out.new_token_ids, out.new_logprobs)]
    return tokens, logprobs


def test_fp8_pages_are_handed_over_and_decoded_as_in_process(tiny_demo_model):
    short, long = list(range(40, 60)), [40 + (i * 7) % 900 for i in range(300)]  # prefilled on decode; on prefill
    expected = [_greedy(tiny_demo_model, prompt, kv_cache_dtype="fp8") for prompt in (short, long)]
    _, unrounded = _greedy(tiny_demo_model, long)
    assert max(abs(a - b) for a, b in zip(unrounded, expected[1][1])) > 1e-3  # fp8 pages show in the logprobs
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1, worker_args=("--kv-cache-dtype", "fp8"))
    try:
        with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            for prompt, (tokens, logprobs) in zip((short, long), expected):
                answer = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, logprobs=0,
                                                   extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
                made = answer.choices[0].logprobs
                assert [int(t.removeprefix("token_id:")) for t in made.tokens] == tokens
                assert max(abs(a - b) for a, b in zip(made.token_logprobs, logprobs)) < 1e-4
        mesh.assert_decode_pools_free()
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())
