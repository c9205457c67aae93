"""The Redis prefix index and instance registry against a real redis-server, and real
prefill and decode workers feeding them: published on prefill, removed on eviction,
lapsing within one TTL, dropped when a worker dies, rebuilt when Redis comes back.

Each test drives its own event loop with asyncio.run: no pytest plugin needed."""
from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis.asyncio

from engine.block_hash import hash_block_chain
from engine.checkpoint import model_fingerprint
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common.registry import InstanceInfo, InstanceRegistry
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.kvstore.prefix_index import PrefixIndex
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.services.service_process import ServiceProcess as Service

BLOCK_SIZE = 16
PREFILL_KV_BLOCKS = 16  # small: one long prompt evicts everything cached
H = [0x1000 + i for i in range(4)]  # stand-ins for a prompt's chained block hashes


def client(url: str) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)


async def until(check, timeout_s: float, poll_s: float = 0.05):
    """Await `check()` until it returns something truthy; that value, or the last one at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(poll_s)


# ---- PrefixIndex ------------------------------------------------------------------------


def test_match_counts_leading_blocks_and_a_gap_ends_the_count(redis_server):
    async def main():
        r = client(redis_server.url)
        index, other_model = PrefixIndex(r, "m-gap"), PrefixIndex(r, "m-gap-other")
        await index.publish("a", H[:3])
        await index.publish("b", [H[0], H[2], H[3]])  # lacks H[1]: H[2:] are useless to it
        await other_model.publish("c", H)
        assert await index.match(H, ["a", "b", "c", "nobody"]) == {"a": 3, "b": 1, "c": 0, "nobody": 0}
        assert await other_model.match(H, ["a", "c"]) == {"a": 0, "c": 4}
        assert await index.match([], ["a"]) == {"a": 0}
        assert await index.match(H, []) == {}
        await r.aclose()

    asyncio.run(main())


def test_a_match_is_one_round_trip_whatever_the_number_of_blocks(redis_server):
    async def main():
        r = client(redis_server.url)
        hashes = list(range(1, 501))
        index = PrefixIndex(r, "m-rtt")
        await index.publish("a", hashes[:300])
        await index.match(hashes[:1], ["a"])  # the script is loaded into Redis on first use
        commands = []
        execute_command = r.execute_command

        async def counted(*args, **kwargs):
            commands.append(args[0])
            return await execute_command(*args, **kwargs)

        def no_pipeline(*args, **kwargs):
            raise AssertionError("a pipeline of commands, where one script call does")

        r.execute_command, r.pipeline = counted, no_pipeline
        assert await index.match(hashes, ["a", "b"]) == {"a": 300, "b": 0}
        assert commands == ["EVALSHA"]
        del r.execute_command, r.pipeline
        await r.aclose()

    asyncio.run(main())


def test_remove_forgets_one_instance_only(redis_server):
    async def main():
        r = client(redis_server.url)
        index = PrefixIndex(r, "m-remove")
        await index.publish("a", H)
        await index.publish("b", H)
        await index.remove("a", H[2:])
        assert await index.match(H, ["a", "b"]) == {"a": 2, "b": 4}
        await index.remove("a", H)
        await index.remove("b", H)
        assert await index.match(H, ["a", "b"]) == {"a": 0, "b": 0}
        assert not await r.exists(*(index.key(h) for h in H))  # an empty sorted set is no key
        await r.aclose()

    asyncio.run(main())


def test_an_entry_lapses_within_one_ttl_of_its_last_refresh(redis_server):
    ttl_s = 1.0

    async def main():
        r = client(redis_server.url)
        index = PrefixIndex(r, "m-ttl", ttl_s=ttl_s)
        await index.publish("a", H[:2])
        await asyncio.sleep(0.6)
        await index.publish("a", H[:1])  # only the first block is refreshed
        last_refresh = time.monotonic()
        await asyncio.sleep(0.5)  # 1.1 s after the first publish: the second block has lapsed
        assert await index.match(H, ["a"]) == {"a": 1}
        assert await until(lambda: _lapsed(index, H[:1], "a"), timeout_s=2 * ttl_s)
        assert time.monotonic() - last_refresh <= ttl_s + 0.3
        # The keys themselves are gone too (their own expiry), members and all.
        assert await until(lambda: _no_keys(r, index, H[:2]), timeout_s=0.5)
        await r.aclose()

    asyncio.run(main())


async def _lapsed(index: PrefixIndex, hashes, instance_id) -> bool:
    return (await index.match(hashes, [instance_id]))[instance_id] == 0


async def _no_keys(r, index: PrefixIndex, hashes) -> bool:
    return not await r.exists(*(index.key(h) for h in hashes))


# ---- InstanceRegistry -------------------------------------------------------------------


def test_registry_lists_live_instances_and_drops_silent_ones(redis_server):
    async def main():
        r = client(redis_server.url)
        registry = InstanceRegistry(r, ttl_s=1.0)
        kind = "test-registry"
        a = InstanceInfo("a", kind, "10.0.0.1:1", "m", 16, queued_tokens=5, free_pages=7, total_pages=9, running=1)
        b = InstanceInfo("b", kind, "10.0.0.2:1", "m", 16)
        assert await registry.heartbeat(b) is True  # unknown to Redis until now
        assert await registry.heartbeat(a) is True
        assert await registry.heartbeat(a) is False
        assert await registry.instances(kind) == [a, b]
        assert await registry.instances("test-registry-other") == []
        await registry.remove(kind, "b")
        assert await registry.instances(kind) == [a]
        last_heartbeat = time.monotonic()
        assert await until(lambda: _no_instances(registry, kind), timeout_s=2.0)
        assert time.monotonic() - last_heartbeat <= 1.3
        assert not await r.exists(registry.key(kind))  # the hash went with its last instance
        await r.aclose()

    asyncio.run(main())


async def _no_instances(registry: InstanceRegistry, kind: str) -> bool:
    return not await registry.instances(kind)


# ---- real workers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fingerprint(tiny_demo_model) -> bytes:
    return model_fingerprint(tiny_demo_model)


@pytest.fixture(scope="module")
def decode(tiny_demo_model, redis_server):
    svc = Service("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "256", "--redis", redis_server.url)
    svc.stub = decode_pb2_grpc.DecodeStub(svc.channel)
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def prefill(tiny_demo_model, redis_server):
    svc = start_prefill(tiny_demo_model, redis_server.url, "prefill-under-test")
    yield svc
    assert svc.terminate() == 0


def start_prefill(model_dir, redis_url: str, instance_id: str | None = None) -> Service:
    args = ("--kv-blocks", str(PREFILL_KV_BLOCKS), "--redis", redis_url)
    svc = Service("prefill", PREFILL_SERVICE, model_dir, *args,
                  *(("--instance-id", instance_id) if instance_id else ()))
    svc.stub = prefill_pb2_grpc.PrefillStub(svc.channel)
    return svc


def prefill_once(prefill: Service, decode: Service, request_id: str, prompt: list[int]) -> None:
    """Prefill `prompt` into pages it reserves on `decode`, then give those pages back."""
    response = prefill.stub.Prefill(prefill_pb2.PrefillRequest(
        request_id=request_id, token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
        target=prefill_pb2.KVTarget(decode_address=decode.address)), timeout=30)
    decode.stub.Abort(decode_pb2.AbortRequest(request_id=response.reservation_id or request_id), timeout=5)


def prompt_of(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 131 + 7 * j) % 1000 + 3 for j in range(num_tokens)]


async def instance(registry: InstanceRegistry, kind: str, address: str) -> InstanceInfo | None:
    return next((info for info in await registry.instances(kind) if info.address == address), None)


def test_workers_register_with_their_address_and_load(redis_server, prefill, decode, fingerprint):
    async def main():
        r = client(redis_server.url)
        registry = InstanceRegistry(r)
        p = await until(lambda: instance(registry, "prefill", prefill.address), timeout_s=3)
        d = await until(lambda: instance(registry, "decode", decode.address), timeout_s=3)
        assert (p.instance_id, p.model_key, p.block_size, p.total_pages) == \
            ("prefill-under-test", fingerprint.hex(), BLOCK_SIZE, PREFILL_KV_BLOCKS)
        assert d.instance_id == "decode-" + decode.address.replace(":", "-")  # the default: kind-host-port
        assert (d.model_key, d.total_pages) == (fingerprint.hex(), 256)
        assert 0 < d.free_pages <= 256 and p.queued_tokens == 0
        await r.aclose()

    asyncio.run(main())


def test_a_prefilled_prompt_is_published_and_leaves_the_index_once_evicted(redis_server, prefill, decode,
                                                                             fingerprint):
    prompt = prompt_of(1, 3 * BLOCK_SIZE + 5)
    chain = hash_block_chain(prompt, BLOCK_SIZE, fingerprint)
    assert len(chain) == 3

    async def main():
        r = client(redis_server.url)
        index = PrefixIndex(r, fingerprint.hex())
        assert await index.match(chain, ["prefill-under-test"]) == {"prefill-under-test": 0}
        await asyncio.to_thread(prefill_once, prefill, decode, "published", prompt)
        published = await until(lambda: _held(index, chain, "prefill-under-test", 3), timeout_s=3)
        assert published, "the prefilled prompt's blocks were never published"
        # A prompt as large as the pool reuses every page: ours are evicted.
        evictor = prompt_of(2, (PREFILL_KV_BLOCKS - 1) * BLOCK_SIZE + 1)  # needs all 16 pages
        await asyncio.to_thread(prefill_once, prefill, decode, "evictor", evictor)
        evicted_at = time.monotonic()
        assert await until(lambda: _held(index, chain, "prefill-under-test", 0), timeout_s=3)
        assert time.monotonic() - evicted_at < 1.0  # one interval (0.25 s), not one index TTL (30 s)
        for h in chain:  # removed, not merely lapsed
            assert await r.zscore(index.key(h), "prefill-under-test") is None
        await r.aclose()

    asyncio.run(main())


def test_an_eviction_while_redis_is_away_leaves_the_index_once_it_answers(redis_server, prefill, decode,
                                                                          fingerprint):
    """Redis stalls but keeps its data (a partition, a starved host): the worker's eviction meanwhile
    cannot be sent, and is sent on its first heartbeat after, not left to lapse one TTL (30 s) later."""
    prompt = prompt_of(4, 2 * BLOCK_SIZE + 3)
    chain = hash_block_chain(prompt, BLOCK_SIZE, fingerprint)
    evictor = prompt_of(5, (PREFILL_KV_BLOCKS - 1) * BLOCK_SIZE + 1)

    async def main():
        r = client(redis_server.url)
        index = PrefixIndex(r, fingerprint.hex())
        await asyncio.to_thread(prefill_once, prefill, decode, "before-the-stall", prompt)
        assert await until(lambda: _held(index, chain, "prefill-under-test", 2), timeout_s=3)
        # Writes wait 2.5 s: the worker's heartbeats time out after 1 s, so it takes Redis for gone.
        await r.execute_command("CLIENT", "PAUSE", "2500", "WRITE")
        paused_at = time.monotonic()
        await asyncio.to_thread(prefill_once, prefill, decode, "evictor-in-the-stall", evictor)
        assert time.monotonic() - paused_at < 2.0, "the eviction must happen while Redis is away"
        for h in chain:  # plain reads still answer (a match is a script: it waits): not removed yet
            assert await r.zscore(index.key(h), "prefill-under-test") is not None
        await asyncio.sleep(max(0.0, 2.5 - (time.monotonic() - paused_at)))
        assert await until(lambda: _held(index, chain, "prefill-under-test", 0), timeout_s=2)
        for h in chain:  # removed, not lapsed
            assert await r.zscore(index.key(h), "prefill-under-test") is None
        await r.aclose()

    asyncio.run(main())


async def _held(index: PrefixIndex, chain, instance_id: str, n: int) -> bool:
    return (await index.match(chain, [instance_id]))[instance_id] == n


def test_redis_going_away_does_not_stop_serving_and_its_return_rebuilds_the_index(redis_server, prefill, decode,
                                                                                   fingerprint):
    prompt = prompt_of(3, 2 * BLOCK_SIZE + 1)
    chain = hash_block_chain(prompt, BLOCK_SIZE, fingerprint)
    redis_server.stop()
    try:
        prefill_once(prefill, decode, "without-redis", prompt)  # served all the same
        time.sleep(0.6)  # heartbeats fail meanwhile
    finally:
        redis_server.start()  # the same port, empty: no persistence

    async def main():
        r = client(redis_server.url)
        index, registry = PrefixIndex(r, fingerprint.hex()), InstanceRegistry(r)
        assert await until(lambda: _held(index, chain, "prefill-under-test", 2), timeout_s=3)
        assert await until(lambda: instance(registry, "prefill", prefill.address), timeout_s=3)
        assert await until(lambda: instance(registry, "decode", decode.address), timeout_s=3)
        # Flushed under the workers' feet (no error for them to notice): the next heartbeat finds
        # Redis did not know them, and they republish.
        await r.flushall()
        assert await until(lambda: _held(index, chain, "prefill-under-test", 2), timeout_s=3)
        await r.aclose()

    asyncio.run(main())


def test_a_killed_worker_drops_out_within_one_heartbeat_ttl_and_a_stopped_one_at_once(redis_server,
                                                                                      tiny_demo_model, decode):
    with ThreadPoolExecutor(2) as starting:  # they load side by side
        killed, stopped = starting.map(lambda _: start_prefill(tiny_demo_model, redis_server.url), range(2))

    async def main():
        r = client(redis_server.url)
        registry = InstanceRegistry(r)
        assert await until(lambda: instance(registry, "prefill", killed.address), timeout_s=3)
        assert await until(lambda: instance(registry, "prefill", stopped.address), timeout_s=3)
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait()
        killed_at = time.monotonic()
        assert await until(lambda: _gone(registry, killed.address), timeout_s=5)
        assert time.monotonic() - killed_at <= registry.ttl_s + 0.5
        assert stopped.terminate() == 0  # SIGTERM: it leaves before exiting
        assert await instance(registry, "prefill", stopped.address) is None
        await r.aclose()

    try:
        asyncio.run(main())
    finally:
        killed.terminate()
        stopped.terminate()


async def _gone(registry: InstanceRegistry, address: str) -> bool:
    return await instance(registry, "prefill", address) is None


# ---- flags ------------------------------------------------------------------------------


def test_redis_and_instance_id_flags(tiny_demo_model):
    from services.decode.config import DecodeServiceConfig
    from services.prefill.config import ConfigError, PrefillServiceConfig

    model = ["--model", str(tiny_demo_model)]
    default = PrefillServiceConfig.from_args(model, env={})
    assert (default.redis_url, default.instance_id) == ("", "")  # no Redis: nothing published
    env = {"BATON_REDIS_URL": "redis://r:6379/0", "BATON_PREFILL_INSTANCE_ID": "p7", "BATON_DECODE_INSTANCE_ID": "d7"}
    prefill = PrefillServiceConfig.from_args(model, env=env)
    decode = DecodeServiceConfig.from_args(model, env=env)
    assert (prefill.redis_url, prefill.instance_id, decode.redis_url, decode.instance_id) == \
        ("redis://r:6379/0", "p7", "redis://r:6379/0", "d7")
    flagged = PrefillServiceConfig.from_args([*model, "--redis", "unix:///run/redis.sock", "--instance-id", "x"],
                                             env=env)
    assert (flagged.redis_url, flagged.instance_id) == ("unix:///run/redis.sock", "x")
    with pytest.raises(ConfigError, match="--redis"):
        PrefillServiceConfig.from_args([*model, "--redis", "localhost:6379"], env={})
