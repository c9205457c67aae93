"""Vertex AI's routes, as SGLang serves them: a prediction (`instances`, `parameters`) is SGLang's
/generate over the instances' prompts, answered as `predictions` in their order; the routes are the
ones Vertex names in AIP_PREDICT_ROUTE and AIP_HEALTH_ROUTE."""
from __future__ import annotations

import httpx
import pytest

from tests.services.gateway.mesh import GatewayProcess

GREEDY = {"sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


def post(base_url: str, path: str, body) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=60)


def test_a_prediction_is_generate_over_the_instances(mesh):
    base = mesh.gateway.base_url
    texts = ["Once upon a time", "The baton passes"]
    predicted = post(base, "/vertex_generate", {"instances": [{"text": t} for t in texts], "parameters": GREEDY})
    assert predicted.status_code == 200, predicted.text
    predictions = predicted.json()["predictions"]
    generated = post(base, "/generate", {"text": texts, **GREEDY}).json()
    assert [p["text"] for p in predictions] == [g["text"] for g in generated]
    assert [p["meta_info"]["completion_tokens"] for p in predictions] == [6, 6]
    by_ids = post(base, "/vertex_generate", {"instances": [{"input_ids": [5, 6, 7, 8]}], "parameters": GREEDY})
    assert by_ids.status_code == 200
    assert by_ids.json()["predictions"][0]["text"] == post(base, "/generate", {"input_ids": [5, 6, 7, 8],
                                                                                   **GREEDY}).json()["text"]
    assert post(base, "/vertex_generate", {"instances": []}).json() == {"predictions": []}
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize("body, param", [
    ([1, 2], "body"),
    ({"instances": "hi"}, "instances"),
    ({"instances": [{"text": "a"}, {"input_ids": [1]}]}, "instances"),
    ({"instances": [{"prompt": "a"}]}, "instances"),
    ({"instances": [{"text": "a"}], "parameters": {"stream": True}}, "parameters.stream"),
    ({"instances": [{"text": "a"}], "parameters": {"text": "b"}}, "parameters"),
    ({"instances": [{"text": "a"}], "parameters": {"sampling_params": {"temperature": -1}}}, None),
])
def test_a_prediction_that_cannot_be_made_is_a_400(mesh, body, param):
    answer = post(mesh.gateway.base_url, "/vertex_generate", body)
    assert answer.status_code == 400, answer.text
    if param is not None:
        assert answer.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def vertex_gateway(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode],
                             env={"AIP_PREDICT_ROUTE": "/v1/endpoints/e/deployedModels/m:predict",
                                  "AIP_HEALTH_ROUTE": "/alive"})
    yield gateway
    assert gateway.terminate() == 0


def test_the_routes_are_those_vertex_names(vertex_gateway):
    base = vertex_gateway.base_url
    predicted = post(base, "/v1/endpoints/e/deployedModels/m:predict",
                     {"instances": [{"text": "Once upon a time"}], "parameters": GREEDY})
    assert predicted.status_code == 200 and len(predicted.json()["predictions"]) == 1
    assert post(base, "/vertex_generate", {"instances": []}).status_code == 404
    alive = httpx.get(f"{base}/alive", timeout=10)
    assert (alive.status_code, alive.json()) == (200, {"status": "ok"})
