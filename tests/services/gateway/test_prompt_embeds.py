"""vLLM's prompt embeddings through the mesh, by the `openai` client: /v1/completions' prompt_embeds
(base64 of torch.save'd tensors) on a gateway started with --enable-prompt-embeds, prefilled by a
prefill worker (the KV handed to decode) or by the decode worker itself."""
from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.services.gateway.mesh import GatewayProcess, metric_value, running_mesh
from tests.services.gateway.test_conditional_disaggregation import prefills_by_place

LOCAL_LIMIT = 64  # rows up to this are prefilled by the decode worker, more by a prefill worker
SHORT, LONG = 40, 150


@pytest.fixture(scope="module")
def embedding_table(mesh) -> torch.Tensor:
    weights = load_file(str(mesh.model_dir / "model.safetensors"))
    return weights["model.embed_tokens.weight"].float()


@pytest.fixture(scope="module")
def gateway(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--enable-prompt-embeds",
                             "--local-prefill-max-tokens", str(LOCAL_LIMIT))
    yield gateway
    assert gateway.terminate() == 0


@pytest.fixture(scope="module")
def embeds_gateway(gateway):
    with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def encoded(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 17 * j) % 900 + 5 for j in range(n)]


def greedy(client: openai.OpenAI, model: str, **prompt) -> openai.types.Completion:
    return client.completions.create(model=model, max_tokens=10, temperature=0, extra_body={
        "ignore_eos": True, "return_token_ids": True, **prompt.pop("extra", {})}, **prompt)


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_a_prompts_token_embeddings_give_its_tokens_greedy_output(mesh, embeds_gateway, embedding_table, n):
    prompt = ids(n, seed=n)
    expected = greedy(embeds_gateway, mesh.model_name, prompt=prompt).choices[0]
    for rows in (embedding_table[prompt], embedding_table[prompt].bfloat16().unsqueeze(0)):  # [1, n, h] too
        reply = greedy(embeds_gateway, mesh.model_name, prompt=None, extra={"prompt_embeds": encoded(rows)})
        assert reply.choices[0].text == expected.text
        assert reply.choices[0].token_ids == expected.token_ids
        assert reply.usage.prompt_tokens == n and reply.usage.completion_tokens == 10
    mesh.assert_decode_pools_free()


def test_both_places_computed_prompts_given_as_embeddings(gateway):
    places = prefills_by_place(gateway)  # after the test above
    assert places.get("decode", 0) >= 2 and places.get("prefill", 0) >= 2, places


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_embeddings_of_no_token_give_what_the_engine_gives_for_them(mesh, embeds_gateway, embedding_table, n):
    """Off every token's embedding: only the rows themselves, carried exactly, give these tokens."""
    g = torch.Generator().manual_seed(n)
    rows = embedding_table[ids(n, seed=3)] + 0.5 * embedding_table.std() * torch.randn(n, 64, generator=g)
    engine = LLMEngine(EngineConfig(model=str(mesh.model_dir), dtype="float32", num_kv_blocks=64))
    engine.add_request("r", [0] * n, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                       prompt_embeds=rows)
    while engine.has_unfinished_requests():
        finished = [out for out in engine.step() if out.finished]
    reply = greedy(embeds_gateway, mesh.model_name, prompt=None, extra={"prompt_embeds": encoded(rows)})
    assert reply.choices[0].token_ids == finished[0].token_ids


def test_embeddings_and_prompts_in_one_request_answer_embeddings_first_and_stream(mesh, embeds_gateway,
                                                                                  embedding_table):
    prompts = [ids(SHORT, seed=5), ids(LONG, seed=6)]
    expected = [greedy(embeds_gateway, mesh.model_name, prompt=p).choices[0].text for p in prompts]
    stream = embeds_gateway.completions.create(
        model=mesh.model_name, prompt=[ids(20, seed=7)], max_tokens=10, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "prompt_embeds": [encoded(embedding_table[p]) for p in prompts]})
    texts, usage = [""] * 6, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts[0] == texts[1] == expected[0] and texts[2] == texts[3] == expected[1]
    assert texts[4] == texts[5] == greedy(embeds_gateway, mesh.model_name, prompt=ids(20, seed=7)).choices[0].text
    assert usage.prompt_tokens == SHORT + LONG + 20 and usage.completion_tokens == 60  # a prompt counts once
    mesh.assert_decode_pools_free()


def test_truncate_prompt_tokens_keeps_the_last_rows(mesh, embeds_gateway, embedding_table):
    prompt = ids(LONG, seed=8)
    expected = greedy(embeds_gateway, mesh.model_name, prompt=prompt[-50:])
    reply = greedy(embeds_gateway, mesh.model_name, prompt=None,
                   extra={"prompt_embeds": encoded(embedding_table[prompt]), "truncate_prompt_tokens": 50})
    assert reply.choices[0].token_ids == expected.choices[0].token_ids and reply.usage.prompt_tokens == 50


def refusal(base_url: str, body: dict, path: str = "/v1/completions") -> dict:
    response = httpx.post(f"{base_url}{path}", json={"max_tokens": 4, **body}, timeout=30)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_bad_embeddings_are_refused_and_leave_no_page(mesh, gateway, embedding_table):
    base_url = gateway.base_url
    good = embedding_table[ids(20, seed=9)]
    bad = {
        "not base64": ("@@@", "base64"),
        "not a tensor": (base64.b64encode(b"PK\x03\x04 not a zip").decode(), "torch.save"),
        "a list": (encoded([good]), "must hold a tensor"),
        "the wrong width": (encoded(good[:, :32]), "[tokens, 64]"),
        "integers": (encoded(torch.ones(4, 64, dtype=torch.int64)), "[tokens, 64]"),
        "no rows": (encoded(torch.zeros(0, 64)), "[tokens, 64]"),
        "a NaN": (encoded(torch.full((3, 64), float("nan"))), "not finite"),
    }
    for name, (value, message) in bad.items():
        error = refusal(base_url, {"model": mesh.model_name, "prompt_embeds": value})
        assert message in error["message"] and error["param"] == "prompt_embeds", (name, error)
    for field, value in (("echo", True), ("prompt_logprobs", 1), ("use_beam_search", True)):
        error = refusal(base_url, {"model": mesh.model_name, "prompt_embeds": encoded(good), field: value})
        assert error["param"] == field, error
    error = refusal(base_url, {"model": mesh.model_name, "max_tokens": 2048, "prompt_embeds": encoded(good)})
    assert error["code"] == "context_length_exceeded", error
    chat = refusal(base_url, {"model": mesh.model_name, "messages": [{"role": "user", "content": "x"}],
                              "prompt_embeds": encoded(good)}, "/v1/chat/completions")
    assert chat["param"] == "prompt_embeds" and "/v1/completions" in chat["message"]
    mesh.assert_decode_pools_free()


def test_a_gateway_without_the_flag_refuses_them(mesh, embedding_table):
    error = refusal(mesh.gateway.base_url, {"model": mesh.model_name,
                                            "prompt_embeds": encoded(embedding_table[ids(5, seed=1)])})
    assert "--enable-prompt-embeds" in error["message"] and error["param"] == "prompt_embeds"


def test_the_grpc_api_takes_them_as_its_prompt_embeds_input(mesh, gateway, embeds_gateway, embedding_table):
    prompt = ids(LONG, seed=10)
    expected = greedy(embeds_gateway, mesh.model_name, prompt=prompt).choices[0]
    rows = embedding_table[prompt].bfloat16()
    given = common_pb2.PromptEmbeds(data=rows.view(torch.uint8).numpy().tobytes(), num_rows=LONG, hidden_size=64,
                                    dtype="bfloat16")
    sampling = common_pb2.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def generate(address: str, **request) -> gateway_pb2.GenerateResponse:
        with grpc.insecure_channel(address) as channel:
            responses = list(gateway_pb2_grpc.GenerateStub(channel).Generate(
                gateway_pb2.GenerateRequest(request_id="embeds", **{"sampling": sampling, **request}), timeout=30))
        return responses[-1]

    reply = generate(gateway.grpc_address, prompt_embeds=given)
    assert list(reply.complete.token_ids) == expected.token_ids and reply.complete.usage.prompt_tokens == LONG
    short = common_pb2.PromptEmbeds(data=given.data[:-2], num_rows=LONG, hidden_size=64, dtype="bfloat16")
    refusals = [
        (mesh.gateway.grpc_address, {"prompt_embeds": given}, "prompt_embeds"),  # no --enable-prompt-embeds
        (gateway.grpc_address, {"prompt_embeds": short}, "prompt_embeds"),
        (gateway.grpc_address, {"prompt_embeds": given, "beam_search": gateway_pb2.BeamSearch()}, "beam_search"),
        (gateway.grpc_address, {"prompt_embeds": given, "sampling": common_pb2.SamplingParams(
            max_tokens=4, prompt_logprobs=1)}, "prompt_logprobs"),
        (gateway.grpc_address, {"token_ids": common_pb2.TokenIds(token_ids=[5] * LONG),
                                "sampling": common_pb2.SamplingParams(max_tokens=4, prompt_embeds=given)},
         "sampling.prompt_embeds"),
    ]
    for address, request, param in refusals:
        response = generate(address, **request)
        assert response.error.code == 400 and response.error.param == param, response
    mesh.assert_decode_pools_free()


RESUMES = "baton_gateway_decode_resumes_total"
PAGES = 12  # of 16 tokens: a 32-row prompt's 160 greedy tokens take them all


def test_a_prompt_its_decode_worker_preempted_without_its_rows_is_resumed_with_them(tiny_demo_model):
    """The gateway sends a decode worker no rows. Two prompts given as embeddings whose replies each fill its
    pool: one is preempted, and the other's last pages take its cached ones; without its rows its worker cannot
    compute its prompt again, so it ends the stream and the gateway resumes it there, rows given again
    (GenerateLocally with its output so far). Each reply is its token prompt's, asked alone."""
    table = load_file(str(tiny_demo_model / "model.safetensors"))["model.embed_tokens.weight"].float()
    prompts = [ids(32, seed) for seed in (3, 4)]
    with running_mesh(tiny_demo_model, num_prefill=1, num_decode=1, decode_args=("--kv-blocks", str(PAGES)),
                      gateway_args=("--enable-prompt-embeds", "--local-prefill-max-tokens", "0")) as small:
        with openai.OpenAI(base_url=f"{small.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            def reply(**prompt) -> list[int]:
                return client.completions.create(model=small.model_name, max_tokens=PAGES * 16 - 32, temperature=0,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True,
                                                             **prompt.pop("extra", {})}, **prompt).choices[0].token_ids
            alone = [reply(prompt=prompt) for prompt in prompts]
            before = metric_value(small.gateway.base_url, RESUMES)
            with ThreadPoolExecutor(2) as pool:
                together = list(pool.map(lambda prompt: reply(prompt=None, extra={
                    "prompt_embeds": encoded(table[prompt])}), prompts))
            assert metric_value(small.gateway.base_url, RESUMES) - before >= 1
        assert together == alone
        small.assert_decode_pools_free(num_tokens=PAGES * 16 - 1)
