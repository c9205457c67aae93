"""A decode pool smaller than the model's context: a request it cannot hold is refused before any prefill
(kv_capacity.py), one that gave no max_tokens is cut to what the pool leaves, and routing prefers a decode
worker whose pool holds the request."""
from __future__ import annotations

import httpx
import openai
import pytest

from protos import common_pb2
from services.gateway.kv_capacity import fit_kv_pool, kv_tokens_needed
from services.gateway.request_errors import InvalidRequestError
from services.gateway.workers import Worker, WorkerPool
from tests.services.gateway.mesh import metric_value, running_mesh

PAGES = 40
POOL_TOKENS = PAGES * 16  # under the demo model's context of 2048
PREFILLS = "baton_gateway_prefills_total"


@pytest.fixture(scope="module")
def small(tiny_demo_model):
    with running_mesh(tiny_demo_model, num_prefill=1, num_decode=1, decode_args=("--kv-blocks", str(PAGES)),
                      gateway_args=("--local-prefill-max-tokens", "0")) as mesh:
        yield mesh


def prompt(n: int) -> list[int]:
    return [(7 * i) % 500 + 3 for i in range(n)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt_tokens, max_tokens", [(500, 300), (700, 5)])
def test_a_request_the_decode_pool_cannot_hold_is_refused_before_its_prefill(small, stream, prompt_tokens,
                                                                              max_tokens):
    before = metric_value(small.gateway.base_url, PREFILLS)
    reply = httpx.post(f"{small.gateway.base_url}/v1/completions", timeout=60, json={
        "model": small.model_name, "prompt": prompt(prompt_tokens), "max_tokens": max_tokens, "stream": stream})
    assert reply.status_code == 400, reply.text  # a stream too: refused before its first token, not after
    assert reply.json()["error"] == {
        "message": f"request needs up to {prompt_tokens + max_tokens} tokens of KV, more than the pool's "
                   f"{POOL_TOKENS}", "type": "invalid_request_error", "param": "prompt", "code": None}
    assert metric_value(small.gateway.base_url, PREFILLS) == before
    small.assert_decode_pools_free(num_tokens=POOL_TOKENS - 1)


def test_a_chat_without_max_tokens_is_cut_to_what_the_pool_leaves(small):
    with openai.OpenAI(base_url=f"{small.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(model=small.model_name, temperature=0, extra_body={"ignore_eos": True},
                                               messages=[{"role": "user", "content": "hi " * 150}])
        assert reply.usage.total_tokens == POOL_TOKENS
        assert reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="min_tokens"):  # more than the pool leaves
            client.chat.completions.create(model=small.model_name, messages=[{"role": "user", "content": "hi " * 150}],
                                           extra_body={"min_tokens": POOL_TOKENS})
    small.assert_decode_pools_free(num_tokens=POOL_TOKENS - 1)


def test_a_request_the_pool_holds_whole_is_served_as_asked(small):
    reply = httpx.post(f"{small.gateway.base_url}/v1/completions", timeout=60, json={
        "model": small.model_name, "prompt": prompt(500), "max_tokens": POOL_TOKENS - 500, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == POOL_TOKENS - 500
    small.assert_decode_pools_free(num_tokens=POOL_TOKENS - 1)


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


def test_routing_prefers_a_decode_worker_whose_pool_holds_the_request():
    small_pool, large_pool, unknown = (Worker(name, channel=None, stub=None) for name in ("small", "large", "unknown"))
    small_pool.kv_capacity_tokens, large_pool.kv_capacity_tokens = 640, 1600
    pool = WorkerPool([small_pool, large_pool])
    assert {pool.pick(100, 1000).address for _ in range(4)} == {"large"}
    assert {pool.pick(100, 600).address for _ in range(4)} == {"small", "large"}
    assert {pool.pick(100, 2000).address for _ in range(4)} == {"small", "large"}  # none holds it: refused after
    assert {WorkerPool([small_pool, unknown]).pick(100, 1000).address for _ in range(4)} == {"unknown"}


def test_a_pool_is_fitted_by_cutting_only_a_max_tokens_the_request_did_not_give():
    worker = Worker("w", channel=None, stub=None)
    worker.kv_capacity_tokens = 640
    given = sampling(max_tokens=200)
    assert kv_tokens_needed(prompt(500), given, is_max_tokens_given=True) == 700
    with pytest.raises(InvalidRequestError, match="request needs up to 700 tokens of KV, more than the pool's 640"):
        fit_kv_pool(worker, prompt(500), given, is_max_tokens_given=True)
    filled = sampling(max_tokens=1548)  # what the context check fills in: the context less the prompt
    assert kv_tokens_needed(prompt(500), filled, is_max_tokens_given=False) == 501
    fit_kv_pool(worker, prompt(500), filled, is_max_tokens_given=False)
    assert filled.max_tokens == 140
    with pytest.raises(InvalidRequestError, match="request needs up to 641 tokens"):  # no room left for one token
        fit_kv_pool(worker, prompt(640), sampling(max_tokens=1408), is_max_tokens_given=False)
    fits = sampling(max_tokens=140)
    fit_kv_pool(worker, prompt(500), fits, is_max_tokens_given=True)
    assert fits.max_tokens == 140
    worker.kv_capacity_tokens = None  # a pool holding the whole context: nothing to fit
    unknown = sampling(max_tokens=1548)
    fit_kv_pool(worker, prompt(500), unknown, is_max_tokens_given=False)
    assert unknown.max_tokens == 1548
