"""The host page tier end to end: prefill workers store the prefix blocks they reuse on
a kvstore node, which publishes them into the prefix index; when the worker that holds a
prefix is gone, the router sends the next request for it to another worker together
with the node's address, and that worker reads the prefix instead of computing it."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio

from engine.block_hash import hash_block_chain
from engine.checkpoint import model_fingerprint
from services.common.registry import InstanceRegistry
from services.kvstore.prefix_index import PrefixIndex
from tests.services.gateway.mesh import start_mesh, stop_mesh
from tests.services.test_kvstore_node import KVStoreProcess

BLOCK_SIZE = 16
SYSTEM = [(41 * j) % 900 + 7 for j in range(20 * BLOCK_SIZE)]  # 20 blocks
PROMPT = SYSTEM + [901, 902, 903]


@pytest.fixture(scope="module")
def tier_mesh(tiny_demo_model, redis_server):
    node = KVStoreProcess("--redis", redis_server.url, "--instance-id", "tier")
    try:
        # Every prompt through a prefill worker: decode, which holds what it decoded, would
        # otherwise prefill the repeated prompts itself.
        mesh = start_mesh(tiny_demo_model, num_prefill=2, num_decode=1,
                          gateway_args=("--redis", redis_server.url, "--local-prefill-max-tokens", "0"),
                          worker_args=("--redis", redis_server.url), prefill_args=("--kvstore", node.address))
    except BaseException:
        node.terminate()
        raise
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
        codes["kvstore"] = node.terminate()
    assert all(code == 0 for code in codes.values()), codes


def complete(mesh, prompt: list[int]) -> tuple[str, int]:
    response = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def holders(redis_url: str, model_dir, hashes: list[int]) -> dict[str, tuple[str, int]]:
    """Instance id -> (address, leading blocks of `hashes` held), for prefill workers and kvstore nodes."""
    async def main():
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            registry = InstanceRegistry(r)
            live = [*await registry.instances("prefill"), *await registry.instances("kvstore")]
            fingerprint = model_fingerprint(model_dir)
            held = await PrefixIndex(r, fingerprint.hex()).match(hashes, [i.instance_id for i in live])
            return {i.instance_id: (i.address, held[i.instance_id]) for i in live}
        finally:
            await r.aclose()
    return asyncio.run(main())


def test_a_prefix_outlives_the_worker_that_computed_it(tier_mesh, redis_server):
    model_dir = tier_mesh.model_dir
    fingerprint = model_fingerprint(model_dir)
    hashes = hash_block_chain(PROMPT, BLOCK_SIZE, fingerprint)
    text, cached = complete(tier_mesh, PROMPT)
    assert cached == 0
    time.sleep(0.5)  # published: the next request for it goes to the same worker, which reuses and stores it
    again, cached = complete(tier_mesh, PROMPT)
    assert cached == len(hashes) * BLOCK_SIZE and again == text

    deadline = time.monotonic() + 5
    while True:  # the worker publishes its cache; it stores the blocks on the node, which publishes them
        held = holders(redis_server.url, model_dir, hashes)
        computed_on = [address for instance, (address, n) in held.items() if n == len(hashes) and instance != "tier"]
        if held.get("tier", ("", 0))[1] == len(hashes) and len(computed_on) == 1:
            break
        assert time.monotonic() < deadline, held
        time.sleep(0.1)

    # Without the worker that computed it, the only way to a cache hit is the tier.
    gone = next(p for p in tier_mesh.prefill if p.address == computed_on[0])
    assert gone.terminate() == 0
    time.sleep(0.3)  # the gateway's health watch drops it
    again, cached = complete(tier_mesh, PROMPT)
    assert cached == len(hashes) * BLOCK_SIZE
    assert again == text  # greedy tokens from KV read back equal those from KV computed
    # A new suffix on the same prefix: the surviving worker now holds the prefix itself.
    _, cached = complete(tier_mesh, SYSTEM + [904])
    assert cached == len(SYSTEM)


def test_a_prefix_cache_reset_empties_the_tier_too(tier_mesh, redis_server):
    """`/reset_prefix_cache`: each prefill worker has its kvstore node forget what it stores, and the
    node's hashes leave the index; the prompt is computed whole again."""
    prompt = [(37 * j) % 900 + 11 for j in range(6 * BLOCK_SIZE)] + [905]
    hashes = hash_block_chain(prompt, BLOCK_SIZE, model_fingerprint(tier_mesh.model_dir))
    complete(tier_mesh, prompt)
    time.sleep(0.5)
    assert complete(tier_mesh, prompt)[1] == len(hashes) * BLOCK_SIZE  # reused: stored on the node
    deadline = time.monotonic() + 5
    while holders(redis_server.url, tier_mesh.model_dir, hashes).get("tier", ("", 0))[1] < len(hashes):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    answer = httpx.post(f"{tier_mesh.gateway.base_url}/reset_prefix_cache", timeout=30)
    assert answer.status_code == 200, answer.text
    assert sum(w["num_host_tier_blocks"] for w in answer.json()["workers"]) >= len(hashes)
    deadline = time.monotonic() + 5
    while any(n for _, n in holders(redis_server.url, tier_mesh.model_dir, hashes).values()):
        assert time.monotonic() < deadline, "the index still lists a holder"
        time.sleep(0.1)
    assert complete(tier_mesh, prompt)[1] == 0
