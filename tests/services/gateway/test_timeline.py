"""The request ledger through the real mesh: in the response when asked (a body field or a
header, whole or streamed), from `GET /v1/requests/{id}/timeline` afterwards, and its
phases add up to the end-to-end time."""
from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.timeline import PHASES
from tests.services.gateway.mesh import GatewayProcess


def assert_adds_up(ledger: dict) -> None:
    for choice in ledger["choices"]:
        phases = choice["phases_ms"]
        assert set(phases) == set(PHASES)
        assert all(ms >= 0.0 for ms in phases.values()), phases
        assert abs(sum(phases.values()) - choice["e2e_ms"]) < 1.0, choice
    assert ledger["e2e_ms"] == max(c["e2e_ms"] for c in ledger["choices"])


def test_a_disaggregated_request_gets_its_ledger_and_can_read_it_again(mesh):
    started = time.perf_counter()
    response = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": "the ledger of one request " * 8, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_timeline": True})
    wall_ms = (time.perf_counter() - started) * 1e3
    assert response.status_code == 200, response.text
    body = response.json()
    ledger = body["timeline"]
    assert ledger["id"] == body["id"] and ledger["object"] == "baton.request.timeline"
    assert_adds_up(ledger)
    (choice,) = ledger["choices"]
    assert choice["status"] == "finished" and choice["prefilled_on"] == "prefill"
    assert choice["request_id"] == body["id"]
    phases = choice["phases_ms"]
    for phase in ("ingress", "tokenize", "route", "prefill_admit", "prefill_compute", "kv_transfer", "rpc",
                  "first_token", "decode_steps", "detokenize_egress"):
        assert phases[phase] > 0.0, (phase, phases)
    assert phases["host_tier_read"] == 0.0 and phases["failed"] == 0.0
    assert ledger["e2e_ms"] < wall_ms

    again = httpx.get(f"{mesh.gateway.base_url}/v1/requests/{body['id']}/timeline", timeout=10)
    assert again.status_code == 200 and again.json() == ledger


def test_a_stream_asked_by_header_ends_with_its_ledger_before_done(mesh):
    with httpx.stream("POST", f"{mesh.gateway.base_url}/v1/chat/completions", timeout=30,
                      headers={"X-Baton-Timeline": "1"}, json={
                          "model": mesh.model_name, "messages": [{"role": "user", "content": "hello there"}],
                          "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, "n": 2,
                          "stream_options": {"include_usage": True}}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and "usage" not in last
    ledger = last["timeline"]
    assert ledger["id"] == last["id"] and len(ledger["choices"]) == 2
    assert [c["request_id"] for c in ledger["choices"]] == [f"{last['id']}-0", f"{last['id']}-1"]
    assert_adds_up(ledger)
    assert json.loads(events[-3])["usage"]["completion_tokens"] == 12


def test_the_openai_client_reads_the_ledger_and_unasked_responses_have_none(mesh):
    client = openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="none")
    asked = client.completions.create(model=mesh.model_name, prompt="one two three", max_tokens=4,
                                      extra_body={"return_timeline": True})
    assert_adds_up(asked.model_extra["timeline"])
    plain = client.completions.create(model=mesh.model_name, prompt="one two three", max_tokens=4)
    assert "timeline" not in (plain.model_extra or {})
    kept = httpx.get(f"{mesh.gateway.base_url}/v1/requests/{plain.id}/timeline", timeout=10).json()
    assert_adds_up(kept)


def test_a_failed_request_is_kept_with_its_reason_and_an_unknown_id_is_404(mesh):
    response = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30,
                          headers={"x-request-id": "cmpl-too-long"},
                          json={"model": mesh.model_name, "prompt": [5] * 10, "max_tokens": 10**6})
    assert response.status_code == 400
    ledger = httpx.get(f"{mesh.gateway.base_url}/v1/requests/cmpl-too-long/timeline", timeout=10).json()
    (choice,) = ledger["choices"]
    assert choice["status"] == "context_length_exceeded" and choice["phases_ms"]["decode_steps"] == 0.0
    assert_adds_up(ledger)

    missing = httpx.get(f"{mesh.gateway.base_url}/v1/requests/cmpl-never/timeline", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "timeline_not_found"


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_only_token_is_the_prefill_workers_keeps_its_phases(mesh, stream):
    """Its last delta is its first: the gRPC API closes the stream right after it, and the
    prefill worker's split of the wait must be on the ledger by then."""
    request_id = f"grpc-one-token-{stream}"
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        responses = list(gateway_pb2_grpc.GenerateStub(channel).Generate(gateway_pb2.GenerateRequest(
            request_id=request_id, token_ids=common_pb2.TokenIds(token_ids=[11, 12, 13] * 30),
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            stream_options=gateway_pb2.StreamOptions(stream=stream)), timeout=30))
    assert responses[-1].HasField("complete"), responses[-1]
    ledger = httpx.get(f"{mesh.gateway.base_url}/v1/requests/{request_id}/timeline", timeout=10).json()
    (choice,) = ledger["choices"]
    assert choice["status"] == "finished" and choice["prefilled_on"] == "prefill"
    phases = choice["phases_ms"]
    assert phases["prefill_admit"] > 0.0 and phases["prefill_compute"] > 0.0 and phases["rpc"] > 0.0, phases
    assert phases["kv_transfer"] == 0.0 and phases["decode_steps"] == 0.0
    # Its one token's way out is the first token's, however its consumer ended the stream.
    assert phases["first_token"] > 0.0 and phases["detokenize_egress"] == 0.0, phases
    assert_adds_up(ledger)


@pytest.fixture(scope="module")
def local_gateway(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--local-prefill-max-tokens", "4096")
    yield gateway
    assert gateway.terminate() == 0


def test_a_prompt_prefilled_on_decode_has_no_prefill_worker_phases(mesh, local_gateway):
    body = httpx.post(f"{local_gateway.base_url}/v1/completions", timeout=30, json={
        # Enough tokens that they come in more than one chunk: a chunk after the first marks decode_steps
        # (8 once all came in the first, the decode worker's engine done before its stream first wrote).
        "model": mesh.model_name, "prompt": [7, 8, 9, 10] * 10, "max_tokens": 64, "temperature": 0,
        "ignore_eos": True, "return_timeline": True}).json()
    (choice,) = body["timeline"]["choices"]
    assert choice["prefilled_on"] == "decode"
    phases = choice["phases_ms"]
    assert phases["tokenize"] < 1.0  # token ids given: no tokenizer call
    assert phases["prefill_queue"] == 0.0 and phases["kv_transfer"] == 0.0
    assert phases["prefill_compute"] > 0.0 and phases["decode_steps"] > 0.0
    assert_adds_up(body["timeline"])


def test_a_prefill_worker_on_this_host_tells_the_two_legs_of_rpc_apart(mesh):
    """Its stamps and the gateway's, on one monotonic clock: the prompt's way there and the first
    token's way back, each some of `rpc` and together no more than it."""
    body = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": "two legs " * 20, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_timeline": True}).json()
    (choice,) = body["timeline"]["choices"]
    legs, rpc = choice["rpc_legs_ms"], choice["phases_ms"]["rpc"]
    assert set(legs) == {"to_prefill", "from_prefill"}
    assert all(0.0 < ms < rpc for ms in legs.values()), (legs, rpc)
    assert legs["to_prefill"] + legs["from_prefill"] <= rpc + 0.05, (legs, rpc)


@pytest.fixture(scope="module")
def gateway_elsewhere(mesh):
    """A gateway that takes itself for another host's: its prefill worker's clock is not its own."""
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], env={"BATON_HOST_ID": "another-host"})
    yield gateway
    assert gateway.terminate() == 0


def test_a_prefill_worker_on_another_host_leaves_rpc_whole(mesh, gateway_elsewhere):
    body = httpx.post(f"{gateway_elsewhere.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": "one leg " * 20, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_timeline": True}).json()
    (choice,) = body["timeline"]["choices"]
    assert "rpc_legs_ms" not in choice and choice["phases_ms"]["rpc"] > 0.0
    assert_adds_up(body["timeline"])
