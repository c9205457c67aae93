"""The model's recommended sampling (generation_config.json, vLLM's --generation-config) for what a
request leaves out, through a real gateway: on the HTTP API and the gRPC API alike, never over what
the request gives."""
from __future__ import annotations

import json

import grpc
import openai
import pytest

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.services.gateway.mesh import GatewayProcess

MESSAGES = [{"role": "user", "content": "Count to ten."}]


@pytest.fixture
def gateway(mesh, request):
    """A second gateway over the mesh's workers, with the test's flags."""
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], *request.param)
    try:
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            yield gateway, client
    finally:
        assert gateway.terminate() == 0


def chat(client, mesh, **kwargs) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, **kwargs,
                                          extra_body={"ignore_eos": True})


GREEDY_THREE = ("--override-generation-config", json.dumps({"temperature": 0, "max_new_tokens": 3}))


@pytest.mark.parametrize("gateway", [GREEDY_THREE], indirect=True)
def test_defaults_fill_what_a_request_leaves_out_and_never_what_it_gives(mesh, client, gateway):
    process, defaulted = gateway
    greedy = chat(client, mesh, temperature=0, max_tokens=3)
    left_out = chat(defaulted, mesh)
    assert left_out.usage.completion_tokens == 3  # max_new_tokens, for a request that gives no max_tokens
    assert left_out.choices[0].message.content == greedy.choices[0].message.content  # temperature 0
    # Given, the request's own: the same seeded sample as on a gateway without defaults.
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
    assert chat(defaulted, mesh, **seeded).choices[0].message.content == \
        chat(client, mesh, **seeded).choices[0].message.content
    assert chat(defaulted, mesh, max_tokens=9).usage.completion_tokens == 9
    with grpc.insecure_channel(process.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        [reply] = stub.Generate(gateway_pb2.GenerateRequest(
            chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in MESSAGES]),
            sampling=common_pb2.SamplingParams(ignore_eos=True)), timeout=30)
    assert reply.complete.usage.completion_tokens == 3
    assert reply.complete.text == greedy.choices[0].message.content


@pytest.fixture(scope="module")
def top_k_one(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("generation-config")
    (directory / "generation_config.json").write_text(json.dumps({"top_k": 1, "do_sample": True}))
    return str(directory)


@pytest.mark.parametrize("gateway", [("--generation-config", "vllm")], indirect=True)
def test_vllm_turns_the_defaults_off(mesh, client, gateway):
    _, plain = gateway
    seeded = {"temperature": 1.0, "seed": 11, "max_tokens": 12}
    assert chat(plain, mesh, **seeded).choices[0].message.content == \
        chat(client, mesh, **seeded).choices[0].message.content


def test_a_directorys_generation_config_is_read(mesh, client, top_k_one):
    # top_k 1 from the file: a sample at temperature 1 is the greedy text.
    process = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--generation-config", top_k_one)
    try:
        with openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0) as topk:
            seeded = {"temperature": 1.0, "seed": 3, "max_tokens": 16}
            greedy = chat(client, mesh, temperature=0, max_tokens=16).choices[0].message.content
            assert chat(topk, mesh, **seeded).choices[0].message.content == greedy
            # top_k given (-1: off) wins over the file's: the sample a gateway without defaults draws.
            unbounded = topk.chat.completions.create(model=mesh.model_name, messages=MESSAGES, **seeded,
                                                     extra_body={"ignore_eos": True, "top_k": -1})
            assert unbounded.choices[0].message.content == chat(client, mesh, **seeded).choices[0].message.content
            assert unbounded.choices[0].message.content != greedy
    finally:
        assert process.terminate() == 0
