"""The prefix-aware router against a real Redis: where the prefix is, against load; the
imbalance guard; Redis gone → load only, and back → prefix routing again."""
from __future__ import annotations

import asyncio
import time

import redis.asyncio
import redis.exceptions
from prometheus_client import REGISTRY

from engine.block_hash import hash_block_chain
from services.common.redis_client import connect_redis
from services.common.registry import InstanceInfo, InstanceRegistry
from services.gateway.index_mirror import IndexMirror
from services.gateway.router import PrefixRouter, RouterConfig
from services.gateway.workers import Worker, WorkerPool
from services.kvstore.prefix_index import PrefixIndex

FINGERPRINT = b"router-test-fp16"
BLOCK_SIZE = 16
PROMPT = list(range(100, 100 + 10 * BLOCK_SIZE))  # ten full blocks


def workers(n: int) -> WorkerPool:
    # Routing reads addresses and load only; no channel is needed to choose.
    return WorkerPool([Worker(f"10.0.0.{i}:50052", channel=None, stub=None) for i in range(n)], "prefill")


async def register(registry: InstanceRegistry, pool: WorkerPool) -> None:
    """What each worker's heartbeat does."""
    for i, worker in enumerate(pool.workers):
        await registry.heartbeat(InstanceInfo(instance_id=f"prefill-{i}", kind="prefill", address=worker.address,
                                              model_key=FINGERPRINT.hex(), block_size=BLOCK_SIZE, queued_tokens=0,
                                              free_pages=100, running=0, waiting=0))


async def retrying(fn, attempts: int = 20):
    """`await fn()`, again after a connection error: the first command on a pooled connection
    to a restarted Redis fails."""
    for attempt in range(attempts):
        try:
            return await fn()
        except redis.exceptions.ConnectionError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.05)


async def make_router(url: str, pool: WorkerPool, *, is_mirrored: bool = False,
                      **config) -> tuple[PrefixRouter, PrefixIndex, InstanceRegistry]:
    """Without `is_mirrored`, every lookup asks Redis (what a router does while its mirror is not synced)."""
    client = connect_redis(url)
    index = PrefixIndex(client, FINGERPRINT.hex(), ttl_s=30)
    registry = InstanceRegistry(client)
    await register(registry, pool)
    mirror = IndexMirror(client, index, retry_s=0.1) if is_mirrored else None
    router = PrefixRouter(pool, index, registry, fingerprint=FINGERPRINT, block_size=BLOCK_SIZE,
                          config=RouterConfig(instances_refresh_s=0.05, redis_retry_s=0.2, **config), redis=client,
                          mirror=mirror)
    router.start()
    for _ in range(100):  # until the instance map is read (and the index mirrored)
        if len(router._instance_ids) == len(pool.workers) and (mirror is None or mirror.is_synced):
            break
        await asyncio.sleep(0.02)
    return router, index, registry


def test_a_prompt_goes_where_its_prefix_is_unless_that_worker_is_swamped(redis_server, redis_client):
    async def main():
        pool = workers(3)
        router, index, _ = await make_router(redis_server.url, pool, balance_abs_tokens=4096, balance_rel=2.0)
        try:
            hashes = hash_block_chain(PROMPT, BLOCK_SIZE, FINGERPRINT)
            await index.publish("prefill-2", hashes[:8])
            await index.publish("prefill-1", hashes[:3])
            assert [(await router.pick(PROMPT)).worker.address for _ in range(4)] == [pool.workers[2].address] * 4
            # Prompts nobody holds: where the fewest blocks went lately (worker 2 has had PROMPT's
            # 10), the least loaded of equals...
            pool.workers[0].queued_tokens = 48  # 3 blocks: less than computing a 4-block prompt anew
            others = [list(range(5000 + 1000 * k, 5000 + 1000 * k + 4 * BLOCK_SIZE)) for k in range(4)]
            firsts = [(await router.pick(other)).worker.address for other in others]
            assert firsts == [pool.workers[i].address for i in (1, 0, 1, 0)]
            # ...and the same prompt again, before its blocks can be in the index, follows the first.
            assert [(await router.pick(other)).worker.address for other in others] == firsts
            # Worth 8 blocks of compute, but 10000 tokens queued: another worker wins.
            pool.workers[0].queued_tokens = 0
            pool.workers[2].queued_tokens = 10_000
            assert (await router.pick(PROMPT)).worker.address != pool.workers[2].address
        finally:
            await router.close()
    asyncio.run(main())


def test_redis_down_routes_by_load_and_prefix_routing_resumes_when_it_returns(redis_server, redis_client):
    async def main():
        pool = workers(2)
        router, index, registry = await make_router(redis_server.url, pool)
        try:
            hashes = hash_block_chain(PROMPT, BLOCK_SIZE, FINGERPRINT)
            await index.publish("prefill-1", hashes)
            assert (await router.pick(PROMPT)).worker.address == pool.workers[1].address
            redis_server.stop()
            picks = {(await router.pick(PROMPT)).worker.address for _ in range(4)}  # load only: in turn
            assert picks == {w.address for w in pool.workers}
            assert REGISTRY.get_sample_value("baton_router_redis_up") == 0
            redis_server.start()  # empty again: the workers register and publish anew
            await retrying(lambda: register(registry, pool))
            await retrying(lambda: index.publish("prefill-1", hashes))
            for _ in range(50):  # retried every redis_retry_s; a stale pooled connection may fail once more
                await asyncio.sleep(0.1)
                await router.pick(PROMPT)
                if REGISTRY.get_sample_value("baton_router_redis_up") == 1:
                    break
            assert REGISTRY.get_sample_value("baton_router_redis_up") == 1
            assert [(await router.pick(PROMPT)).worker.address for _ in range(4)] == [pool.workers[1].address] * 4
        finally:
            await router.close()
    asyncio.run(main())


def test_one_worker_needs_no_lookup(redis_server):
    async def main():
        pool = workers(1)
        router, _, _ = await make_router(redis_server.url, pool)
        try:
            assert (await router.pick(PROMPT)).worker is pool.workers[0]
        finally:
            await router.close()
    asyncio.run(main())


def test_new_prefixes_spread_evenly_whatever_the_queues(redis_server, redis_client):
    async def main():
        pool = workers(2)
        router, index, _ = await make_router(redis_server.url, pool)
        try:
            pool.workers[1].queued_tokens = 3000  # busy now: load alone would send every new prefix to 0
            systems = [list(range(10_000 * (k + 1), 10_000 * (k + 1) + 20 * BLOCK_SIZE)) for k in range(8)]
            placed = [(await router.pick(system)).worker.address for system in systems]
            assert placed.count(pool.workers[0].address) == placed.count(pool.workers[1].address) == 4
            assert REGISTRY.get_sample_value("baton_router_requests_total", {"decision": "spread"}) >= 8
        finally:
            await router.close()
    asyncio.run(main())


def test_one_slow_lookup_routes_its_request_by_load_but_does_not_turn_redis_off(redis_server, redis_client):
    async def main():
        pool = workers(2)
        router, index, _ = await make_router(redis_server.url, pool, redis_timeout_s=0.05,
                                             redis_down_after_timeouts=3)
        try:
            hashes = hash_block_chain(PROMPT, BLOCK_SIZE, FINGERPRINT)
            await index.publish("prefill-1", hashes)
            assert (await router.pick(PROMPT)).num_cached_tokens == len(PROMPT)
            redis_client.execute_command("CLIENT", "PAUSE", "300", "ALL")  # Redis stalls, as on a starved host
            assert (await router.pick(PROMPT)).num_cached_tokens == 0  # timed out: this one by load
            assert REGISTRY.get_sample_value("baton_router_redis_up") == 1
            await asyncio.sleep(0.4)
            assert (await router.pick(PROMPT)).num_cached_tokens == len(PROMPT)  # the next lookup is used
            redis_client.execute_command("CLIENT", "PAUSE", "600", "ALL")
            for _ in range(3):  # three slow lookups in a row: Redis counts as down
                await router.pick(PROMPT)
            assert REGISTRY.get_sample_value("baton_router_redis_up") == 0
        finally:
            redis_client.execute_command("CLIENT", "UNPAUSE")
            await router.close()
    asyncio.run(main())


def test_a_mirrored_router_routes_by_prefix_without_asking_redis(redis_server, redis_client):
    async def main():
        pool = workers(2)
        router, index, registry = await make_router(redis_server.url, pool, is_mirrored=True)
        try:
            hashes = hash_block_chain(PROMPT, BLOCK_SIZE, FINGERPRINT)
            await index.publish("prefill-1", hashes)
            for _ in range(100):  # the announcement reaches the mirror
                if router.mirror.match(hashes, ["prefill-1"])["prefill-1"]:
                    break
                await asyncio.sleep(0.02)
            redis_client.execute_command("CLIENT", "PAUSE", "1000", "ALL")
            start = time.monotonic()
            routes = [await router.pick(PROMPT) for _ in range(4)]
            assert time.monotonic() - start < 0.2  # asking Redis would wait out the pause (or time out)
            assert [(r.worker.address, r.num_cached_tokens) for r in routes] == [(pool.workers[1].address,
                                                                                   len(PROMPT))] * 4
            redis_client.execute_command("CLIENT", "UNPAUSE")
            redis_server.stop()  # the mirror loses Redis: lookups ask it, fail, and route by load
            for _ in range(100):
                if not router.mirror.is_synced:
                    break
                await asyncio.sleep(0.02)
            picks = {(await router.pick(PROMPT)).worker.address for _ in range(4)}
            assert picks == {w.address for w in pool.workers}
            redis_server.start()
            await retrying(lambda: register(registry, pool))
            await retrying(lambda: index.publish("prefill-1", hashes))
            # Until the mirror has read the index again and a lookup has found Redis up. A pooled
            # connection that the restart closed may fail a direct lookup first (Redis counts as
            # down for redis_retry_s then), so the state is waited for, not assumed.
            for _ in range(200):
                if (router.mirror.is_synced and (await router.pick(PROMPT)).num_cached_tokens
                        and REGISTRY.get_sample_value("baton_router_redis_up") == 1):
                    break
                await asyncio.sleep(0.05)
            assert router.mirror.is_synced, "the mirror did not read the index again within 10 s"
            assert REGISTRY.get_sample_value("baton_router_redis_up") == 1, "no lookup found Redis up within 10 s"
            routes = [await router.pick(PROMPT) for _ in range(4)]
            assert [(r.worker.address, r.num_cached_tokens) for r in routes] == [(pool.workers[1].address,
                                                                                   len(PROMPT))] * 4
            assert REGISTRY.get_sample_value("baton_router_redis_up") == 1
        finally:
            redis_client.execute_command("CLIENT", "UNPAUSE")
            await router.close()
    asyncio.run(main())


def test_a_lookup_hashes_the_prompt_only_as_far_as_some_worker_holds_it(redis_server, redis_client):
    """The rest of the chain is hashed by the route's bookkeeping, once the prompt is sent."""
    async def main():
        pool = workers(2)
        router, index, _ = await make_router(redis_server.url, pool, is_mirrored=True)
        try:
            new = await router.lookup([7] * len(PROMPT))
            assert new.hashes.num_computed == 1 and new.matched == {pool.workers[0].address: 0,
                                                                     pool.workers[1].address: 0}
            await index.publish("prefill-1", hash_block_chain(PROMPT, BLOCK_SIZE, FINGERPRINT)[:6])
            for _ in range(100):  # until the mirror has the blocks
                lookup = await router.lookup(PROMPT)
                if lookup.matched[pool.workers[1].address] == 6:
                    break
                await asyncio.sleep(0.02)
            assert lookup.matched[pool.workers[1].address] == 6
            # Read: the six held and the one that ended the match (computed: twice as many as before, at most).
            assert lookup.hashes.num_computed == 8 < len(lookup.hashes) == len(PROMPT) // BLOCK_SIZE
            route = router.choose(PROMPT, lookup)
            assert route.worker is pool.workers[1] and route.num_cached_tokens == 6 * BLOCK_SIZE
            router.record(route, lookup)
            assert lookup.hashes.num_computed == len(PROMPT) // BLOCK_SIZE
        finally:
            await router.close()

    asyncio.run(main())


def test_decode_workers_known_to_be_full_are_passed_over_while_the_registry_answers(redis_server, redis_client):
    """The router keeps each decode worker's room from its heartbeat; the decode pool's pick passes over one
    without room for the prompt while another has it (all of them when none has), and while the registry
    does not answer nothing is known (a worker full once is not passed over for good)."""
    async def main():
        prefill = workers(1)
        decode = WorkerPool([Worker(f"10.0.1.{i}:50053", channel=None, stub=None) for i in range(2)], "decode")
        client = connect_redis(redis_server.url)
        registry = InstanceRegistry(client)
        await register(registry, prefill)
        for i, free_pages in enumerate((1, 50)):  # room for 16 tokens, for 800
            await registry.heartbeat(InstanceInfo(instance_id=f"decode-{i}", kind="decode",
                                                  address=decode.workers[i].address, model_key=FINGERPRINT.hex(),
                                                  block_size=BLOCK_SIZE, free_pages=free_pages))
        router = PrefixRouter(prefill, PrefixIndex(client, FINGERPRINT.hex()), registry, fingerprint=FINGERPRINT,
                              block_size=BLOCK_SIZE, config=RouterConfig(instances_refresh_s=0.05), redis=client,
                              decode=decode)
        router.start()
        try:
            for _ in range(100):
                if decode.workers[1].free_tokens is not None:
                    break
                await asyncio.sleep(0.02)
            assert [w.free_tokens for w in decode.workers] == [16, 800]
            assert {decode.pick(100) for _ in range(4)} == {decode.workers[1]}
            assert {decode.pick(10) for _ in range(4)} == set(decode.workers)  # both have room: in turn
            assert {decode.pick(1000) for _ in range(4)} == set(decode.workers)  # neither has: by load alone
            assert decode.pick_other([decode.workers[1]], 100) is decode.workers[0]
            redis_server.stop()
            for _ in range(200):
                if decode.workers[1].free_tokens is None:
                    break
                await asyncio.sleep(0.02)
            assert [w.free_tokens for w in decode.workers] == [None, None]
        finally:
            redis_server.start()
            await router.close()
    asyncio.run(main())
