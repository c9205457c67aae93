"""`--api-key`: a gateway that asks for a key refuses the OpenAI client, plain HTTP and gRPC
callers without one (401 / UNAUTHENTICATED, nothing reserved), serves those with any of its
keys, and leaves probes and scrapes open. A second gateway over the package mesh's workers."""
from __future__ import annotations

import anthropic
import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.settings import ConfigError
from services.gateway.api_keys import ApiKeys
from services.gateway.config import GatewayConfig
from tests.services.gateway.mesh import GatewayProcess

KEYS = ("sk-current", "sk-next")  # two at once, as while rotating one


@pytest.fixture(scope="module")
def keyed(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--api-key", KEYS[0], "--api-key", KEYS[1],
                             "--local-prefill-max-tokens", "0")
    try:
        yield gateway
    finally:
        assert gateway.terminate() == 0


def completion(mesh, gateway: GatewayProcess, api_key: str, stream: bool = False):
    """The whole completion, or with `stream` its text as streamed."""
    with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key, max_retries=0) as client:
        answer = client.completions.create(model=mesh.model_name, prompt="The quick brown fox", max_tokens=4,
                                           temperature=0, stream=stream)
        return "".join(chunk.choices[0].text for chunk in answer if chunk.choices) if stream else answer


def test_the_openai_client_with_a_wrong_key_gets_401_and_nothing_is_reserved(mesh, keyed):
    with pytest.raises(openai.AuthenticationError) as refused:
        completion(mesh, keyed, "sk-guess")
    assert refused.value.status_code == 401
    assert refused.value.body == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                  "param": None, "code": "invalid_api_key"}
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize("key", KEYS)
def test_either_key_is_served_whole_and_streamed(mesh, keyed, key):
    whole = completion(mesh, keyed, key)
    assert whole.usage.completion_tokens == 4
    assert completion(mesh, keyed, key, stream=True) == whole.choices[0].text


def test_a_request_without_a_key_is_refused_before_its_body_is_read(mesh, keyed):
    body_over_the_limit = {"model": mesh.model_name, "prompt": "x" * (9 * 2**20)}  # 413 if it were read
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{keyed.base_url}{path}", json=body_over_the_limit, timeout=30)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in response.json()["error"]["message"]


def test_every_path_asks_for_a_key_but_the_probes_and_scrapes(keyed):
    for path in ("/v1/models", "/v1/requests/none/timeline"):
        assert httpx.get(f"{keyed.base_url}{path}", timeout=10).status_code == 401
        assert httpx.get(f"{keyed.base_url}{path}", headers={"Authorization": "Basic sk-current"},
                         timeout=10).status_code == 401
    for path in ("/tokenize", "/detokenize"):  # vLLM leaves these open; they are API too
        assert httpx.post(f"{keyed.base_url}{path}", json={"prompt": "x"}, timeout=10).status_code == 401
    tokenized = httpx.post(f"{keyed.base_url}/tokenize", json={"prompt": "x"},
                           headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10)
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    lowercase_scheme = httpx.get(f"{keyed.base_url}/v1/models", headers={"Authorization": f"bearer {KEYS[1]}"},
                                 timeout=10)
    assert lowercase_scheme.status_code == 200 and lowercase_scheme.json()["data"]
    for path in ("/health", "/live", "/metrics", "/ping"):  # /ping: SageMaker's health check
        assert httpx.get(f"{keyed.base_url}{path}", timeout=10).status_code == 200
    assert httpx.post(f"{keyed.base_url}/invocations", json={"prompt": "x"}, timeout=10).status_code == 401
    metrics = httpx.get(f"{keyed.base_url}/metrics", timeout=10).text
    refused = [line for line in metrics.splitlines()
               if line.startswith("baton_request_errors_total") and 'reason="unauthorized"' in line]
    assert refused and float(refused[0].rsplit(" ", 1)[1]) >= 2


def test_grpc_generate_asks_for_the_key_in_its_metadata(mesh, keyed):
    request = gateway_pb2.GenerateRequest(model=mesh.model_name, text="The quick brown fox",
                                          sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0))
    with grpc.insecure_channel(keyed.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        for metadata in ((), (("authorization", "Bearer sk-guess"),)):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, metadata=metadata, timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answered = list(stub.Generate(request, metadata=(("authorization", f"Bearer {KEYS[0]}"),), timeout=30))
        assert answered[-1].complete.usage.completion_tokens == 3
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    mesh.assert_decode_pools_free()


def test_anthropics_client_sends_its_key_as_x_api_key(mesh, keyed):
    # ignore_eos: a sampled reply of the tiny model may end at its first token (a CI run's did).
    asked = dict(model=mesh.model_name, max_tokens=3, messages=[{"role": "user", "content": "Hi."}],
                 extra_body={"ignore_eos": True})
    with anthropic.Anthropic(base_url=keyed.base_url, api_key=KEYS[1], max_retries=0) as client:
        assert client.messages.create(**asked).usage.output_tokens == 3
    with anthropic.Anthropic(base_url=keyed.base_url, api_key="sk-guess", max_retries=0) as client, \
            pytest.raises(anthropic.AuthenticationError):
        client.messages.create(**asked)


def test_a_gateway_without_keys_asks_for_none(mesh):
    assert completion(mesh, mesh.gateway, "anything").usage.completion_tokens == 4


@pytest.mark.parametrize(("authorization", "admitted"), [
    ("Bearer k1", True), ("bearer k2", True), ("BEARER k1 ", True), ("Bearer k3", False), ("Bearer k", False),
    ("Bearer k1k1", False), ("k1", False), ("Basic k1", False), ("Bearer ", False), ("", False), (None, False),
    (b"Bearer k2", True),
])
def test_admits_only_a_bearer_of_one_of_the_keys(authorization, admitted):
    assert ApiKeys(["k1", "k2"]).admits(authorization) is admitted
    assert [ApiKeys(["k1", "k2"]).admits_key(key) for key in ("k2", b"k1", "k", "", None)] == [
        True, True, False, False, False]


def test_keys_come_from_the_flags_or_else_the_variable_and_stay_out_of_the_repr(tiny_demo_model):
    base = ["--model", str(tiny_demo_model), "--tokenizer", "h:1", "--prefill", "h:2", "--decode", "h:3"]
    env = {"BATON_API_KEY": "sk-from-env"}
    assert GatewayConfig.from_args(base, env={}).api_keys == ()
    assert GatewayConfig.from_args(base, env=env).api_keys == ("sk-from-env",)
    flagged = GatewayConfig.from_args([*base, "--api-key", "a", "--api-key", "b"], env=env)
    assert flagged.api_keys == ("a", "b")
    assert "sk-from-env" not in repr(GatewayConfig.from_args(base, env=env))
    for bad in ("", "two words"):
        with pytest.raises(ConfigError, match="--api-key"):
            GatewayConfig.from_args([*base, "--api-key", bad], env={})
