"""`--max-num-requests`: a gateway holding as many requests as it takes refuses the next with
429 `overloaded` and Retry-After (the openai client waits and retries), and serves again once
one ends. A gateway of its own over the package mesh's workers."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.services.gateway.mesh import GatewayProcess

LIMIT = 2


@pytest.fixture(scope="module")
def limited(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--max-num-requests", str(LIMIT),
                             "--local-prefill-max-tokens", "0")
    try:
        yield gateway
    finally:
        assert gateway.terminate() == 0


class LongStream:
    """A streamed completion of 1900 tokens (about 2 s here), open once its first chunk is in;
    `close` hangs up, which ends the request."""

    def __init__(self, mesh, client: httpx.Client, gateway: GatewayProcess):
        self.stream = client.stream("POST", f"{gateway.base_url}/v1/completions", timeout=60, json={
            "model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True,
            "stream": True})
        response = self.stream.__enter__()
        assert response.status_code == 200
        # Held, not dropped: collecting a half-read iterator closes the response, and the request with it.
        self.lines = response.iter_lines()
        assert next(line for line in self.lines if line.startswith("data: "))

    def close(self) -> None:
        self.stream.__exit__(None, None, None)


def in_progress(gateway: GatewayProcess) -> float:
    metrics = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    [line] = [line for line in metrics.splitlines() if line.startswith("baton_gateway_requests_in_progress{")]
    return float(line.rsplit(" ", 1)[1])


def test_past_the_limit_a_request_gets_429_and_once_one_ends_it_is_served(mesh, limited):
    with httpx.Client() as client:
        held = [LongStream(mesh, client, limited) for _ in range(LIMIT)]
        try:
            refused = client.post(f"{limited.base_url}/v1/completions", timeout=30,
                                  json={"model": mesh.model_name, "prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
            assert "--max-num-requests" in error["message"]
            assert in_progress(limited) == LIMIT
            with openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key="unused", max_retries=0) as api:
                with pytest.raises(openai.RateLimitError):
                    api.chat.completions.create(model=mesh.model_name, max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
                with pytest.raises(openai.RateLimitError):  # each input to embed counts as a request
                    api.embeddings.create(model=mesh.model_name, input="hi")
        finally:
            held[0].close()  # its client gone: the request ends, its place frees
        deadline = time.monotonic() + 5
        while True:
            served = client.post(f"{limited.base_url}/v1/completions", timeout=30,
                                 json={"model": mesh.model_name, "prompt": "hi", "max_tokens": 2})
            if served.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert served.status_code == 200, served.text
        two = client.post(f"{limited.base_url}/v1/embeddings", timeout=30, json={"model": mesh.model_name,
                                                                                  "input": ["a", "b"]})
        assert two.status_code == 429, two.text  # one place free, two inputs
        assert client.post(f"{limited.base_url}/v1/embeddings", timeout=30,
                           json={"model": mesh.model_name, "input": "a"}).status_code == 200
        for stream in held[1:]:
            stream.close()
    deadline = time.monotonic() + 5  # a hang-up is seen by the gateway a moment after it
    while in_progress(limited) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_progress(limited) == 0
    metrics = httpx.get(f"{limited.base_url}/metrics", timeout=10).text
    assert any('reason="overloaded"' in line and not line.endswith(" 0.0") for line in metrics.splitlines()
               if line.startswith("baton_request_errors_total"))
    mesh.assert_decode_pools_free()


def test_the_openai_client_waits_out_retry_after_and_gets_its_answer(mesh, limited):
    with httpx.Client() as client:
        held = [LongStream(mesh, client, limited) for _ in range(LIMIT)]
        start = time.monotonic()
        # Freed while the client waits out its first Retry-After.
        release = threading.Timer(0.3, lambda: [stream.close() for stream in held])
        release.start()
        with openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key="unused", max_retries=2) as api:
            answer = api.completions.create(model=mesh.model_name, prompt="hi", max_tokens=2)
        release.join()
    assert answer.usage.completion_tokens == 2
    assert time.monotonic() - start >= 0.9  # it did wait: Retry-After is a second
