"""Prefix-aware routing end to end: workers publish what they cache into a real Redis,
and the gateway sends requests that share a prefix to the worker that holds it."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.services.gateway.mesh import start_mesh, stop_mesh

PREFIX_TOKENS = 320  # 20 blocks
SYSTEM_PROMPTS = [[(37 * j + 11 * k) % 900 + 5 for j in range(PREFIX_TOKENS)] for k in range(4)]


@pytest.fixture(scope="module")
def routed_mesh(tiny_demo_model, redis_server):
    mesh = start_mesh(tiny_demo_model, num_prefill=2, num_decode=1, gateway_args=("--redis", redis_server.url),
                      worker_args=("--redis", redis_server.url))
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes


def cached_tokens(mesh, prompt: list[int]) -> int:
    response = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_requests_sharing_a_prefix_land_where_it_is_cached(routed_mesh):
    for k, system in enumerate(SYSTEM_PROMPTS):  # each prefix computed once, on some worker
        assert cached_tokens(routed_mesh, system + [950 + k]) == 0
    time.sleep(0.5)  # the workers publish what they cached
    hits = [cached_tokens(routed_mesh, system + [960 + k, 961 + i])
            for i in range(3) for k, system in enumerate(SYSTEM_PROMPTS)]
    # Load-only routing would alternate workers and miss about half of these.
    assert all(hit >= PREFIX_TOKENS for hit in hits), hits
