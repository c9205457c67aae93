"""SageMaker's routes, as vLLM serves them: `/ping` is the health check, and `/invocations` sends each
body where its fields say it belongs, answering as that API does."""
from __future__ import annotations

import httpx
import pytest


def post(mesh, path: str, body) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", json=body, timeout=60)


def test_ping_is_the_health_check(mesh):
    for method in ("GET", "POST"):
        answer = httpx.request(method, f"{mesh.gateway.base_url}/ping", timeout=10)
        assert (answer.status_code, answer.json()) == (200, {"status": "ok"})


def test_invocations_answers_as_each_api_does(mesh):
    chat = {"model": mesh.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0}
    completion = {"model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    for body, path, kind in ((chat, "/v1/chat/completions", "chat.completion"),
                             (completion, "/v1/completions", "text_completion"),
                             ({"model": mesh.model_name, "input": ["a b c"]}, "/v1/embeddings", "list")):
        invoked, direct = post(mesh, "/invocations", body), post(mesh, path, body)
        assert invoked.status_code == direct.status_code == 200, invoked.text
        assert invoked.json()["object"] == direct.json()["object"] == kind
        if kind != "list":
            assert invoked.json()["choices"][0] == direct.json()["choices"][0]
    ranked = post(mesh, "/invocations", {"model": mesh.model_name, "query": "a", "documents": ["a", "b"]})
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2
    scored = post(mesh, "/invocations", {"model": mesh.model_name, "text_1": "a", "text_2": "b"})
    assert scored.status_code == 200 and scored.json()["object"] == "list"
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize("body", [{"model": "x", "neither": 1}, [1, 2], "text"])
def test_a_body_of_no_api_is_a_400(mesh, body):
    answer = post(mesh, "/invocations", body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "body"
