"""Conditional disaggregation: a second gateway over the same workers lets the decode
worker prefill short prompts itself. Same tokens as the disaggregated path, no prefill
worker involved, and long prompts still go to prefill."""
from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.services.gateway.mesh import GatewayProcess, answer_aborted_while_paused

LOCAL_LIMIT = 64


@pytest.fixture(scope="module")
def local_gateway(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--local-prefill-max-tokens", str(LOCAL_LIMIT))
    yield gateway
    assert gateway.terminate() == 0


def prefills_by_place(gateway) -> dict[str, float]:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    return {sample.labels["place"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "baton_gateway_prefills" for sample in family.samples
            if sample.name == "baton_gateway_prefills_total"}


def complete(gateway, model: str, prompt, **extra) -> dict:
    response = httpx.post(f"{gateway.base_url}/v1/completions", timeout=30, json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_short_prompts_are_prefilled_by_decode_with_the_same_tokens(mesh, local_gateway):
    short = [(7 * j) % 900 + 5 for j in range(40)]
    long = [(11 * j) % 900 + 5 for j in range(200)]
    for prompt in (short, long):
        expected = complete(mesh.gateway, mesh.model_name, prompt)["choices"][0]["text"]
        assert complete(local_gateway, mesh.model_name, prompt)["choices"][0]["text"] == expected
    assert prefills_by_place(local_gateway) == {"decode": 1.0, "prefill": 1.0}
    streamed = httpx.post(f"{local_gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": short, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}).text
    assert streamed.rstrip().endswith("data: [DONE]") and '"completion_tokens":12' in streamed
    mesh.assert_decode_pools_free()


def test_a_locally_prefilled_stream_cancelled_frees_its_pages(mesh, local_gateway):
    host, port = local_gateway.http_address.rsplit(":", 1)
    payload = json.dumps({"model": mesh.model_name, "prompt": [5, 6, 7], "max_tokens": 1900, "stream": True,
                          "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()
    mesh.assert_decode_pools_free(within_s=1.0)


def test_a_local_prefill_gives_the_prompt_logprobs_a_prefill_worker_gives(mesh, local_gateway):
    short = [(5 * j) % 900 + 5 for j in range(30)]
    local = complete(local_gateway, mesh.model_name, short, prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    remote = complete(mesh.gateway, mesh.model_name, short, prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    assert len(local) == len(short) and local[0] is None
    assert [set(r) for r in local[1:]] == [set(r) for r in remote[1:]]
    for mine, theirs in zip(local[1:], remote[1:]):
        for token_id, entry in mine.items():
            assert entry["logprob"] == pytest.approx(theirs[token_id]["logprob"], abs=1e-4)
    mesh.assert_decode_pools_free()


def test_a_local_prefill_is_guided_as_a_prefill_worker_guides_it(mesh, local_gateway):
    short = [(3 * j) % 900 + 5 for j in range(20)]
    regex = r"(yes|no|maybe), [0-9]{2}"
    local = complete(local_gateway, mesh.model_name, short, guided_regex=regex)["choices"][0]
    remote = complete(mesh.gateway, mesh.model_name, short, guided_regex=regex)["choices"][0]
    assert re.fullmatch(regex, local["text"]) and local["text"] == remote["text"]
    assert local["finish_reason"] == "stop"
    mesh.assert_decode_pools_free()


def test_a_prompt_its_decode_worker_is_prefilling_is_aborted_at_once(mesh, local_gateway):
    """The decode workers paused (SIGSTOP), a short prompt's local prefill cannot end: /abort_request by
    its x-request-id ends it anyway, with no text, and once the workers go on no page stays held."""
    body = answer_aborted_while_paused(mesh.decode, lambda: httpx.post(
        f"{local_gateway.base_url}/v1/completions", timeout=30, headers={"x-request-id": "prefilling-locally"},
        json={"model": mesh.model_name, "prompt": [5, 6, 7], "max_tokens": 8}).json(), local_gateway.base_url,
        "prefilling-locally")
    assert body["choices"][0]["finish_reason"] == "abort" and body["choices"][0]["text"] == "", body
    assert prefills_by_place(local_gateway)["decode"] >= 1
    mesh.assert_decode_pools_free()
