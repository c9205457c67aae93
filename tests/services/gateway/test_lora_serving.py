"""LoRA adapters through the mesh, as vLLM's `--lora-modules` serves them: a gateway and workers
started with an adapter list it in /v1/models, and a request naming it as its model (HTTP or gRPC)
is computed with it on prefill and decode, whether prefilled by a prefill worker (KV handed over)
or by its decode worker; its output equals the engine's with the same adapter."""
from __future__ import annotations

import grpc
import openai
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.lora_adapters import ALL_PROJECTIONS, make_adapter
from tests.services.gateway.mesh import start_mesh, stop_mesh

transformers = pytest.importorskip("transformers")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter(tiny_demo_model, tmp_path_factory):
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_demo_model, dtype="float32")
    where = tmp_path_factory.mktemp("lora") / "tuned"
    make_adapter(where, base, ALL_PROJECTIONS, 4, 8.0, False, seed=5)
    return where


@pytest.fixture(scope="module")
def lora_mesh(tiny_demo_model, adapter):
    # The gateway's default local prefill: short prompts prefill on their decode worker, long ones on
    # the prefill worker, whose KV the decode worker then reads.
    flags = ("--lora-modules", f"tuned={adapter}")
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1, gateway_args=flags, worker_args=flags)
    try:
        yield mesh
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


def engine_outputs(model_dir, adapter, prompts: list[list[int]], lora_name: str | None) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128,
                                    lora_modules=(("tuned", str(adapter)),)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora_name=lora_name)
    finished = {out.request_id: out.token_ids for out in engine.generate(prompts, params) if out.finished}
    return [finished[request_id] for request_id in sorted(finished, key=lambda r: int(r.removeprefix("gen-")))]


def test_a_request_naming_the_adapter_is_computed_with_it_on_every_path(lora_mesh, adapter):
    short, long = list(range(40, 60)), [40 + (i * 7) % 900 for i in range(300)]  # prefilled on decode; on prefill
    tuned = engine_outputs(lora_mesh.model_dir, adapter, [short, long], "tuned")
    base = engine_outputs(lora_mesh.model_dir, adapter, [short, long], None)
    assert tuned != base  # the adapter changes the output enough to tell
    with openai.OpenAI(base_url=f"{lora_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {lora_mesh.model_name, "tuned"}
        assert cards["tuned"].root == str(adapter) and cards["tuned"].parent == lora_mesh.model_name
        for name, expected in (("tuned", tuned), (lora_mesh.model_name, base)):
            for prompt, tokens in zip((short, long), expected):
                answer = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   logprobs=0, extra_body={"ignore_eos": True,
                                                                           "return_tokens_as_token_ids": True})
                assert answer.model == name
                made = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
                assert made == tokens, (name, len(prompt))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="untuned", prompt="hi", max_tokens=1)
    with grpc.insecure_channel(lora_mesh.gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        greedy = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        [done] = [r for r in stub.Generate(gateway_pb2.GenerateRequest(
            model="tuned", token_ids=common_pb2.TokenIds(token_ids=long), sampling=greedy), timeout=60)
            if r.HasField("complete")]
        assert list(done.complete.token_ids) == tuned[1]
        unknown = common_pb2.SamplingParams(max_tokens=2, lora_name="untuned")
        [refused] = stub.Generate(gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=short),
                                                              sampling=unknown), timeout=30)
        assert refused.error.code == 400 and refused.error.param == "sampling.lora_name"
    lora_mesh.assert_decode_pools_free()
