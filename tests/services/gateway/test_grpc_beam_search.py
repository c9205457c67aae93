"""Beam search by the public gRPC API (`GenerateRequest.beam_search`): the beams of
`transformers.generate(num_beams=n)` and of the HTTP API's `use_beam_search`, whole and streamed,
from token ids, text and chat; what it cannot honour refused naming the field; a cancelled call
stops the search."""
from __future__ import annotations

import grpc
import httpx
import pytest

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.services.gateway.test_beam_search import (  # noqa: F401 (hf_model: a fixture)
    PROMPT,
    assert_leaving_stops_the_search,
    assert_same_beams,
    hf_model,
    transformers_beams,
)


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        yield gateway_pb2_grpc.GenerateStub(channel)


def beam_request(n: int, max_tokens: int, length_penalty: float | None = None, stream: bool = False,
                 **sampling) -> gateway_pb2.GenerateRequest:
    search = gateway_pb2.BeamSearch() if length_penalty is None else gateway_pb2.BeamSearch(
        length_penalty=length_penalty)
    return gateway_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(token_ids=PROMPT), n=n, beam_search=search,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, logprobs=1, **sampling),
        stream_options=gateway_pb2.StreamOptions(stream=stream))


def completes(responses) -> list[gateway_pb2.GenerateComplete]:
    """Each choice's complete, by index; fails on an error message."""
    found = {}
    for response in responses:
        assert response.WhichOneof("response") != "error", response.error
        if response.HasField("complete"):
            found[response.complete.index] = response.complete
    return [found[i] for i in sorted(found)]


def beams_of(choices, length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    return [(list(c.token_ids), sum(entry.sampled.logprob for entry in c.logprobs) / len(c.token_ids) ** length_penalty)
            for c in choices]


def test_the_beams_are_transformers_and_the_http_apis(stub, mesh, hf_model):  # noqa: F811
    choices = completes(stub.Generate(beam_request(3, 6, ignore_eos=True), timeout=60))
    assert [c.index for c in choices] == [0, 1, 2]
    assert all(c.finish_reason == common_pb2.FINISH_REASON_LENGTH for c in choices)
    assert_same_beams(beams_of(choices), transformers_beams(hf_model, PROMPT, 3, 6, None))
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in choices] == [(len(PROMPT), 6)] * 3
    http = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=60, json={
        "model": mesh.model_name, "prompt": PROMPT, "n": 3, "max_tokens": 6, "ignore_eos": True,
        "use_beam_search": True}).json()
    assert [c.text for c in choices] == [c["text"] for c in http["choices"]]


def test_an_end_token_and_a_length_penalty_rank_as_in_transformers(stub, hf_model):  # noqa: F811
    free = completes(stub.Generate(beam_request(3, 6, ignore_eos=True), timeout=60))
    end = list(free[0].token_ids)[2]
    choices = completes(stub.Generate(beam_request(3, 8, length_penalty=2.0, ignore_eos=True, stop_token_ids=[end]),
                                      timeout=60))
    assert_same_beams(beams_of(choices, 2.0), transformers_beams(hf_model, PROMPT, 3, 8, [end], 2.0))


def test_a_stream_sends_each_beam_whole_then_its_complete(stub):
    whole = completes(stub.Generate(beam_request(2, 5), timeout=60))
    responses = list(stub.Generate(beam_request(2, 5, stream=True), timeout=60))
    kinds = [(r.WhichOneof("response"), getattr(r, r.WhichOneof("response")).index) for r in responses]
    assert kinds == [("chunk", 0), ("complete", 0), ("chunk", 1), ("complete", 1)]
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    assert [(c.text, list(c.token_ids)) for c in chunks] == [(c.text, list(c.token_ids)) for c in whole]


def test_chat_beams_are_the_rendered_conversations_beams(stub, mesh):
    messages = [{"role": "user", "content": "Name three colours."}]
    rendered = ModelTokenizer.from_dir(mesh.model_dir).apply_chat_template(messages, add_generation_prompt=True)[1]
    sampling = common_pb2.SamplingParams(max_tokens=5)
    chat = completes(stub.Generate(gateway_pb2.GenerateRequest(
        chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in messages]), n=2,
        beam_search=gateway_pb2.BeamSearch(), sampling=sampling), timeout=60))
    ids = completes(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(token_ids=rendered), n=2, beam_search=gateway_pb2.BeamSearch(),
        sampling=sampling), timeout=60))
    assert [c.text for c in chat] == [c.text for c in ids]
    assert chat[0].usage.prompt_tokens == len(rendered)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 11}, "n"),
    ({"stop": ["x"]}, "stop"),
    ({"length_penalty": float("nan")}, "beam_search.length_penalty"),
    ({"presence_penalty": 1.0}, "sampling.presence_penalty"),
    ({"frequency_penalty": -0.5}, "sampling.frequency_penalty"),
    ({"repetition_penalty": 1.2}, "sampling.repetition_penalty"),
    ({"logit_bias": {5: 1.0}}, "sampling.logit_bias"),
    ({"min_tokens": 2}, "sampling.min_tokens"),
    ({"allowed_token_ids": [5, 6]}, "sampling.allowed_token_ids"),
    ({"bad_words": [common_pb2.TokenIds(token_ids=[5])]}, "sampling.bad_words"),
    ({"thinking_budget": common_pb2.ThinkingBudget(max_tokens=0)}, "sampling.thinking_budget"),
    ({"guided_regex": "[a-z]+"}, "beam_search"),
])
def test_what_beam_search_cannot_honour_is_a_400_naming_it(stub, mesh, fields, param):
    request = beam_request(2, 4)
    if "n" in fields:
        request.n = fields["n"]
    elif "stop" in fields:
        request.stop.extend(fields["stop"])
    elif "length_penalty" in fields:
        request.beam_search.length_penalty = fields["length_penalty"]
    else:
        request.sampling.MergeFrom(common_pb2.SamplingParams(**fields))
    [response] = stub.Generate(request, timeout=30)
    assert response.WhichOneof("response") == "error", response
    assert (response.error.code, response.error.param) == (400, param)
    mesh.assert_decode_pools_free()


def test_a_neutral_repetition_penalty_is_no_refusal(stub):
    assert len(completes(stub.Generate(beam_request(2, 3, repetition_penalty=1.0), timeout=60))) == 2


def test_a_cancelled_call_stops_the_search(stub, mesh):
    call = stub.Generate(beam_request(4, 1500, ignore_eos=True, stream=True), timeout=60)
    assert_leaving_stops_the_search(mesh, call.cancel)
