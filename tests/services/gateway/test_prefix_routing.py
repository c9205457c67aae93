"""Prefix-aware routing end to end: workers publish what they cache into a real Redis,
and the gateway sends requests that share a prefix to the worker that holds it."""
from __future__ import annotations

import base64
import io
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from protos import decode_pb2, decode_pb2_grpc
from tests.services.gateway.mesh import (
    BLOCK_SIZE,
    WHOLE_POOL_TOKENS,
    GatewayProcess,
    gateway_client,
    metric_value,
    start_mesh,
    stop_mesh,
)

PREFIX_TOKENS = 320  # 20 blocks
SYSTEM_PROMPTS = [[(37 * j + 11 * k) % 900 + 5 for j in range(PREFIX_TOKENS)] for k in range(4)]


@pytest.fixture(scope="module")
def routed_mesh(tiny_demo_model, redis_server):
    # Every prompt through a prefill worker (the routing under test): decode publishes what it
    # holds too, and would prefill a repeated prompt itself.
    mesh = start_mesh(tiny_demo_model, num_prefill=2, num_decode=1,
                      gateway_args=("--redis", redis_server.url, "--local-prefill-max-tokens", "0"),
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


def test_a_salted_prefix_is_shared_only_with_requests_giving_its_salt(routed_mesh):
    """vLLM's cache_salt through the mesh: the router matches, and the workers cache, a salted
    prompt's blocks under its salt. Were a salt ignored, prefix routing would send the first request
    of another salt (or none) to the worker holding the prefix, and it would hit there."""
    system = [(41 * j + 7) % 900 + 5 for j in range(PREFIX_TOKENS)]
    with openai.OpenAI(base_url=f"{routed_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        def cached(tail: int, salt: str | None = None) -> int:
            salted = None if salt is None else {"cache_salt": salt}
            response = client.completions.create(model=routed_mesh.model_name, prompt=system + [tail], max_tokens=2,
                                                 temperature=0, extra_body=salted)
            return response.usage.prompt_tokens_details.cached_tokens

        assert cached(950, "tenant-a") == 0
        time.sleep(0.5)  # the worker publishes what it cached
        hits = [cached(951 + i, "tenant-a") for i in range(3)]
        assert all(hit >= PREFIX_TOKENS for hit in hits), hits  # found, and routed to, by its salt
        assert [cached(960, "tenant-b"), cached(961)] == [0, 0]
        time.sleep(0.5)
        assert min(cached(962, "tenant-b"), cached(963)) >= PREFIX_TOKENS  # each now has its own
        with pytest.raises(openai.BadRequestError) as refused:
            cached(964, "")
        assert refused.value.body["param"] == "cache_salt"


def test_a_prompt_given_as_embeddings_shares_its_blocks_only_with_the_same_embeddings(routed_mesh, redis_server):
    """Its placeholder tokens are all alike: were it not salted with its embeddings (the gateway's salt
    matching the workers'), the router would send the second prompt to the worker holding the first,
    and it would hit there; were the salts unlike, the repeats would go by load and miss half the time."""
    table = load_file(str(routed_mesh.model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    given = [table[[(43 * j + 13 * k) % 900 + 5 for j in range(PREFIX_TOKENS + 1)]] for k in range(2)]
    with gateway_client(routed_mesh, "--redis", redis_server.url, "--local-prefill-max-tokens", "0",
                        "--enable-prompt-embeds") as client:
        def cached(rows) -> int:
            saved = io.BytesIO()
            torch.save(rows, saved)
            response = client.completions.create(model=routed_mesh.model_name, prompt=None, max_tokens=2,
                                                 extra_body={"prompt_embeds": base64.b64encode(saved.getvalue())
                                                             .decode()})
            return response.usage.prompt_tokens_details.cached_tokens

        assert cached(given[0]) == 0
        time.sleep(0.5)  # the worker publishes what it cached
        hits = [cached(given[0]) for _ in range(4)]
        assert all(hit >= PREFIX_TOKENS for hit in hits), hits
        assert cached(given[1]) == 0
        decisions = router_metrics(str(client.base_url).removesuffix("/v1/"))
        assert decisions.get("prefix") == 4, decisions  # the repeats found by their salted hashes


def test_a_prompt_whose_logprobs_are_asked_for_is_placed_by_load(routed_mesh):
    # Its prefix is cached (the test above), but it is computed whole: routing by prefix would only
    # pile such prompts onto the worker that holds it.
    before = router_metrics(routed_mesh)
    response = httpx.post(f"{routed_mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": routed_mesh.model_name, "prompt": SYSTEM_PROMPTS[0] + [970], "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 0})
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and len(choice["prompt_logprobs"]) == PREFIX_TOKENS + 1
    after = router_metrics(routed_mesh)
    assert after.get("prefix", 0) == before.get("prefix", 0)
    assert sum(after.values()) == sum(before.values()) + 1  # routed once, by load
    assert cached_tokens(routed_mesh, SYSTEM_PROMPTS[0] + [971]) >= PREFIX_TOKENS  # the others still by prefix


def router_metrics(mesh_or_url) -> dict[str, float]:
    base_url = mesh_or_url if isinstance(mesh_or_url, str) else mesh_or_url.gateway.base_url
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "baton_router_requests_total":
                values[sample.labels["decision"]] = sample.value
            elif sample.name == "baton_router_redis_up":
                values["redis_up"] = sample.value
    return values


def test_redis_stopped_mid_run_serving_goes_on_and_prefix_routing_resumes_after(routed_mesh, redis_server):
    before = router_metrics(routed_mesh)
    redis_server.stop()
    try:
        for k, system in enumerate(SYSTEM_PROMPTS):  # every request still succeeds
            cached_tokens(routed_mesh, system + [970 + k])
        during = router_metrics(routed_mesh)
        assert during["redis_up"] == 0
        assert during.get("load", 0) >= before.get("load", 0) + len(SYSTEM_PROMPTS) - 1  # the first may time out
    finally:
        redis_server.start()  # empty: the workers notice and republish everything they hold
    deadline = time.monotonic() + 10
    while True:
        hits = [cached_tokens(routed_mesh, system + [980 + k]) for k, system in enumerate(SYSTEM_PROMPTS)]
        after = router_metrics(routed_mesh)
        if after["redis_up"] == 1 and after.get("prefix", 0) >= during.get("prefix", 0) + len(SYSTEM_PROMPTS) \
                and all(hit >= PREFIX_TOKENS for hit in hits):
            break
        assert time.monotonic() < deadline, f"prefix routing did not resume: {after}, hits {hits}"
        time.sleep(0.3)


def test_decode_prefills_a_prompt_whose_uncached_part_is_short(routed_mesh, redis_server):
    """Conditional disaggregation weighs what the decode worker does not hold: a prompt far over
    the local limit whose prefix it decoded before is prefilled there, from its cache."""
    local = GatewayProcess(routed_mesh.model_dir, routed_mesh.tokenizer.address,
                           [p.address for p in routed_mesh.prefill], [d.address for d in routed_mesh.decode],
                           "--redis", redis_server.url, "--local-prefill-max-tokens", "64")
    try:
        prompt = [(13 * j) % 900 + 7 for j in range(300)]
        follow_up = prompt + [901 + j for j in range(20)]

        def complete(gateway, tokens):
            body = httpx.post(f"{gateway.base_url}/v1/completions", timeout=30, json={
                "model": routed_mesh.model_name, "prompt": tokens, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_timeline": True}).json()
            choice = body["timeline"]["choices"][0]
            return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"], choice

        _, _, first = complete(local, prompt)
        assert first["prefilled_on"] == "prefill"  # 300 tokens, none on decode: over the limit
        deadline = time.monotonic() + 5
        while True:  # decode publishes the pages prefill handed it; the gateway learns decode's id
            text, cached, again = complete(local, follow_up)
            if again["prefilled_on"] == "decode":
                break
            assert time.monotonic() < deadline, again
            time.sleep(0.3)
        assert cached >= len(prompt) // BLOCK_SIZE * BLOCK_SIZE  # from decode's own prefix cache
        assert again["phases_ms"]["kv_transfer"] == 0.0
        expected, _, disaggregated = complete(routed_mesh.gateway, follow_up)  # the main gateway: limit 0
        assert disaggregated["prefilled_on"] == "prefill" and text == expected
    finally:
        assert local.terminate() == 0


def test_a_decode_worker_known_to_be_full_is_passed_over(tiny_demo_model, redis_server):
    """Decode worker 0 full (its whole pool reserved), as its heartbeat in the registry says: every request
    goes to worker 1, none to worker 0 to wait there for pages (up to the prefill workers' 2 s here) and then
    move (`baton_gateway_full_decode_moves_total`), as every other one did when ties went in turn."""
    import redis

    from services.common.registry import InstanceInfo

    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=2,
                      gateway_args=("--redis", redis_server.url, "--local-prefill-max-tokens", "0"),
                      worker_args=("--redis", redis_server.url), prefill_args=("--kv-reserve-wait-s", "2"),
                      decode_args=("--lease-ms", "120000"))
    hog = decode_pb2_grpc.DecodeStub(mesh.decode[0].channel)
    try:
        hog.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
        with redis.Redis.from_url(redis_server.url) as client:
            def free_pages() -> int:
                infos = [InstanceInfo.from_json(value)[0] for value in client.hgetall("baton:inst:decode").values()]
                return next(info.free_pages for info in infos if info.address == mesh.decode[0].address)

            deadline = time.monotonic() + 10
            while free_pages() > 0:
                assert time.monotonic() < deadline, "the full worker's heartbeat never said so"
                time.sleep(0.05)
        time.sleep(2.5)  # the gateway re-reads the registry every second
        body = {"model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
        replies = [httpx.post(f"{mesh.gateway.base_url}/v1/completions", json=body, timeout=30) for _ in range(4)]
        assert [reply.status_code for reply in replies] == [200] * 4, [reply.text for reply in replies]
        assert metric_value(mesh.gateway.base_url, "baton_gateway_full_decode_moves_total") == 0
        assert hog.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes
