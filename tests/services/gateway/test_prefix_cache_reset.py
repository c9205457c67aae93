"""vLLM's `POST /reset_prefix_cache` (SGLang's `/flush_cache`) through the mesh: every prefill and
decode worker forgets its cached prefixes, so the prompt cached before is computed whole after;
while a request holds pages, its worker refuses and the answer is a 409 naming it."""
from __future__ import annotations

import httpx

from tests.services.gateway.test_bad_input import _raw_stream_request

PROMPT = [5 + (7 * k) % 500 for k in range(100)]  # six whole pages


def cached_tokens(client, mesh) -> int:
    response = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    return response.usage.prompt_tokens_details.cached_tokens


def test_a_reset_forgets_every_workers_cached_prefixes(mesh, client):
    # Cached on both prefill workers by now (without Redis, idle workers take turns).
    assert 96 in [cached_tokens(client, mesh) for _ in range(4)]
    answer = httpx.post(f"{mesh.gateway.base_url}/reset_prefix_cache", timeout=30)
    assert answer.status_code == 200, answer.text
    workers = answer.json()["workers"]
    assert sorted(w["kind"] for w in workers) == ["decode", "decode", "prefill", "prefill"]
    assert all(w["reset"] for w in workers) and sum(w["num_blocks"] for w in workers) >= 6
    assert cached_tokens(client, mesh) == 0
    assert httpx.post(f"{mesh.gateway.base_url}/flush_cache", timeout=30).status_code == 200  # SGLang's name
    mesh.assert_decode_pools_free()


def test_a_worker_holding_a_request_refuses_with_a_409(mesh):
    body = {"model": mesh.model_name, "prompt": "A long story begins", "max_tokens": 1900, "stream": True,
            "ignore_eos": True, "temperature": 0}
    sock = _raw_stream_request(mesh, body)
    try:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # decoding on one decode worker
        answer = httpx.post(f"{mesh.gateway.base_url}/reset_prefix_cache", timeout=30)
    finally:
        sock.close()
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert error["code"] == "workers_busy" and "decode 127.0.0.1:" in error["message"]
    mesh.assert_decode_pools_free()
