"""Routing follows the workers' health: a killed worker drops out of routing and serving goes
on; with no worker of a kind left, `/health` and requests say 503. Its own mesh: it kills workers.
A pool also follows its name's replicas as they are scaled, and a prompt whose prefill worker goes
away before its first token goes to another, and one whose decode worker goes away mid-stream moves."""
from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import decode_pb2, decode_pb2_grpc
from services.common.grpc_server import make_server
from services.common.settings import ConfigError
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.gateway import worker_health
from services.gateway.config import GatewayConfig
from services.gateway.worker_discovery import expand_addresses, follow, needs_resolving, resolved_names
from services.gateway.workers import WorkerPool
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from tests.services.gateway.mesh import (
    DECODE_KV_BLOCKS,
    WHOLE_POOL_TOKENS,
    GatewayProcess,
    assert_decode_pools_free,
    metric_value,
    start_mesh,
    stop_mesh,
)
from tests.services.service_process import (
    RESERVES_ON_ENV,
    WRITES_AFTER_ENV,
    ServiceProcess,
    failing_step_worker,
    metrics_address,
    stop_processes,
    wait_all_serving,
)
from tests.services.waiting import wait_until


@pytest.fixture()
def small_mesh(tiny_demo_model):
    mesh = start_mesh(tiny_demo_model, num_prefill=2, num_decode=1)
    try:
        yield mesh
    finally:
        stop_mesh(mesh)


def complete(mesh) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30,
                      json={"model": mesh.model_name, "prompt": "Hello", "max_tokens": 4})


def test_a_killed_worker_leaves_routing_and_the_last_one_makes_health_503(small_mesh):
    mesh = small_mesh
    assert httpx.get(f"{mesh.gateway.base_url}/health").status_code == 200
    mesh.prefill[0].proc.send_signal(signal.SIGKILL)
    mesh.prefill[0].proc.wait()
    time.sleep(0.5)  # the health stream breaks at once; give the gateway a moment to see it
    for _ in range(6):  # round-robin would have sent half of these to the dead worker
        response = complete(mesh)
        assert response.status_code == 200, response.text

    mesh.decode[0].proc.send_signal(signal.SIGKILL)
    mesh.decode[0].proc.wait()
    wait_until(lambda: httpx.get(f"{mesh.gateway.base_url}/health").status_code == 503, timeout_s=5)
    health = httpx.get(f"{mesh.gateway.base_url}/health").json()
    assert "decode" in health["error"]["message"]
    response = complete(mesh)
    assert response.status_code == 503 and response.json()["error"]["type"]
    assert httpx.get(f"{mesh.gateway.base_url}/live").status_code == 200


def test_a_name_that_resolves_to_several_addresses_stands_for_all_of_them(monkeypatch):
    assert expand_addresses(["127.0.0.1:5", "localhost:6"]) == ["127.0.0.1:5", "localhost:6"]
    assert expand_addresses(["no-such-host.invalid:7"]) == ["no-such-host.invalid:7"]
    # Compose DNS (one A record per replica) does not exist here: answer as it would.
    real = socket.getaddrinfo

    def replicas(host, port, *args, **kwargs):
        if host == "prefill":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.3", "10.0.0.2")]
        return real(host, port, *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", replicas)
    assert expand_addresses(["prefill:50052", "127.0.0.1:9"]) == ["10.0.0.2:50052", "10.0.0.3:50052", "127.0.0.1:9"]


def test_a_pool_follows_its_name_as_replicas_come_and_go(monkeypatch):
    """Replicas as compose runs them: one port, an address each (here 127.0.0.2-4, all on loopback),
    one name resolving to them all; the name's answer changes as the service is scaled."""
    real = socket.getaddrinfo
    answer: list[str] = []

    def replicas(host, port, *args, **kwargs):
        if host == "prefill":
            if not answer:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]
        return real(host, port, *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", replicas)

    async def scenario():
        first, port = await make_server([], ["baton.Test"], address="127.0.0.2:0")
        servers = [first] + [(await make_server([], ["baton.Test"], address=f"127.0.0.{i}:{port}"))[0]
                             for i in (3, 4)]
        for server in servers:
            await server.start()
        addresses = [f"127.0.0.{i}:{port}" for i in (2, 3, 4)]
        answer[:] = ["127.0.0.2", "127.0.0.3"]
        pool = WorkerPool.connect(expand_addresses([f"prefill:{port}"]), health_pb2_grpc.HealthStub, "prefill")
        pool.watch_health("baton.Test")
        removed = []
        pool.on_removed(removed.append)
        follower = asyncio.ensure_future(follow(pool, [resolved_names([f"prefill:{port}"])], every_s=0.05))
        try:
            await until(lambda: pool.num_serving == 2)
            assert [w.address for w in pool.workers] == addresses[:2]
            answer.append("127.0.0.4")  # scaled up: the new replica joins once it serves
            await until(lambda: pool.num_serving == 3)
            assert [w.address for w in pool.workers] == addresses
            leaving = pool.workers[0]
            with pool.hold(leaving):  # a request still on the replica that goes
                answer.remove("127.0.0.2")
                await until(lambda: len(pool.workers) == 2)
                assert removed == [leaving] and not leaving.is_serving
                assert leaving not in pool.serving()
                await asyncio.sleep(0.6)
                assert leaving.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN  # its request goes on
            await until(lambda: leaving.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN, timeout_s=3)
            answer.clear()  # the name does not resolve for a while: the pool stays as it is
            await asyncio.sleep(0.2)
            assert [w.address for w in pool.workers] == addresses[1:] and pool.num_serving == 2
        finally:
            follower.cancel()
            await pool.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(scenario())


def test_a_worker_given_by_name_and_listed_by_its_address_is_one_worker():
    """`--prefill localhost:P --discover-workers`, the registry listing that worker as 127.0.0.1:P (its
    advertised address) beside another: two workers, not three."""
    async def scenario() -> list[str]:
        pool = WorkerPool.connect(expand_addresses(["localhost:5001"]), health_pb2_grpc.HealthStub, "prefill")

        async def registry() -> list[str]:
            return ["127.0.0.1:5001", "127.0.0.1:5002"]
        follower = asyncio.ensure_future(follow(pool, [resolved_names(["localhost:5001"]), registry], every_s=0.02))
        try:
            await until(lambda: len(pool.workers) >= 2)
            await asyncio.sleep(0.1)  # several rounds: none adds the alias
            return [worker.address for worker in pool.workers]
        finally:
            follower.cancel()
            await pool.close()

    assert asyncio.run(scenario()) == ["localhost:5001", "127.0.0.1:5002"]


def test_a_worker_is_routed_to_only_once_it_is_given_what_the_others_have():
    """WorkerPool.before_serving (how runtime-loaded adapters reach a worker that was away): a worker
    whose health says SERVING is out of routing while that fails, and in once it succeeds."""
    async def scenario():
        server, port = await make_server([], ["baton.Test"], address="127.0.0.1:0")
        await server.start()
        pool = WorkerPool.connect([f"127.0.0.1:{port}"], health_pb2_grpc.HealthStub, "decode")
        tries = []

        async def prepare(worker):
            tries.append(worker.address)
            if len(tries) < 3:
                raise RuntimeError("the adapter's files are not there yet")
        pool.before_serving(prepare)
        pool.watch_health("baton.Test")
        try:
            await until(lambda: len(tries) == 2)
            assert pool.num_serving == 0
            await until(lambda: pool.num_serving == 1)  # tried again after a pause, and given it
            assert tries == [f"127.0.0.1:{port}"] * 3
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_a_worker_that_closes_a_healthy_connection_stays_in_routing(monkeypatch):
    """A connection the worker closes while it serves (as it closes a gateway's that could not answer
    its keepalive pings, frozen or starved: here by its maximum age) is made again at once, the worker
    left in routing meanwhile: every worker of a gateway that thaws was out of routing for a round trip
    (a 503 for whatever came in it), before that for WATCH_RETRY_S (378 such 503s)."""
    monkeypatch.setattr(worker_health, "WATCH_RETRY_S", 1.0)

    class CountedHealth(health.aio.HealthServicer):
        num_watches = 0

        async def Watch(self, request, context):
            CountedHealth.num_watches += 1
            await super().Watch(request, context)

    async def scenario() -> bool:
        server, pool = await watched_health_server(CountedHealth(), max_connection_age_ms=2500)
        try:
            await until(lambda: pool.num_serving == 1)
            was_out, end = False, time.monotonic() + 6  # the connection closes twice
            while time.monotonic() < end:
                was_out = was_out or pool.num_serving == 0
                await asyncio.sleep(0.001)
            return was_out
        finally:
            await pool.close()
            await server.stop(None)

    assert not asyncio.run(scenario())
    assert CountedHealth.num_watches >= 3  # the connection did close, twice


def test_a_worker_whose_connection_closes_and_that_does_not_answer_again_leaves_routing(monkeypatch):
    """As above, but the worker is gone by the time it is asked again: out of routing at once."""
    monkeypatch.setattr(worker_health, "WATCH_RETRY_S", 1.0)

    async def scenario() -> float:
        server, pool = await watched_health_server(health.aio.HealthServicer(), max_connection_age_ms=1500)
        try:
            await until(lambda: pool.num_serving == 1)
            await server.stop(None)
            stopped = time.monotonic()
            await until(lambda: pool.num_serving == 0)
            return time.monotonic() - stopped
        finally:
            await pool.close()

    assert asyncio.run(scenario()) < 1.0


async def watched_health_server(servicer: health.aio.HealthServicer,
                                max_connection_age_ms: int) -> tuple[grpc.aio.Server, WorkerPool]:
    """A server of `servicer`, SERVING "baton.Test" and closing each connection at its maximum age, and a
    decode pool watching it."""
    server = grpc.aio.server(options=[("grpc.max_connection_age_ms", max_connection_age_ms),
                                      ("grpc.max_connection_age_grace_ms", 100)])
    await servicer.set("baton.Test", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = WorkerPool.connect([f"127.0.0.1:{port}"], health_pb2_grpc.HealthStub, "decode")
    pool.watch_health("baton.Test")
    return server, pool


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_names_are_resolved_again_as_configured(tiny_demo_model):
    assert not needs_resolving(["127.0.0.1:5", "[::1]:6"]) and needs_resolving(["127.0.0.1:5", "prefill:50052"])
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "prefill:2",
              "--decode", "127.0.0.1:3"]
    assert GatewayConfig.from_args(common, {}).resolve_workers_s == 5.0
    assert GatewayConfig.from_args(common, {"BATON_GATEWAY_RESOLVE_WORKERS_S": "0"}).resolve_workers_s == 0
    for bad in ("-1", "nan"):
        with pytest.raises(ConfigError, match="--resolve-workers-s must be >= 0"):
            GatewayConfig.from_args([*common, "--resolve-workers-s", bad], {})


def test_a_prompt_whose_prefill_worker_goes_away_before_its_first_token_goes_to_another(tiny_demo_model):
    """Prefill worker A's engine fails on a "slowfail-" prompt, after SLOW_FAILING_STEP_S: that
    prompt fails (it may make any worker's engine fail), and the one queued behind it, which A
    answers UNAVAILABLE, is sent to B instead and served, the pages A reserved under its id on the
    decode worker (as it reserves a long prompt's to send them early) freed first: B's Reserve under
    that id was refused (a 400 "already holds blocks"). B is paused until both prompts are on A."""
    with processes() as started:
        tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
        decode = ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", str(DECODE_KV_BLOCKS),
                                wait=False)
        other = ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "128", wait=False)
        wait_serving(started, [decode])  # its address is A's to reserve on
        failing = ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "128",
                                 command=failing_step_worker("prefill"), wait=False,
                                 env={RESERVES_ON_ENV: decode.address})
        wait_serving(started, [tokenizer, failing, other])
        other.proc.send_signal(signal.SIGSTOP)  # the gateway sees it only once it answers
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [failing.address, other.address],
                                 [decode.address], "--local-prefill-max-tokens", "0")
        try:
            def complete(request_id: str) -> httpx.Response:
                return httpx.post(f"{gateway.base_url}/v1/completions", headers={"x-request-id": request_id},
                                  timeout=30, json={"model": tiny_demo_model.name, "prompt": "Hello", "max_tokens": 4})

            with ThreadPoolExecutor(2) as pool:
                doomed = pool.submit(complete, "slowfail-1")
                time.sleep(0.5)
                queued = pool.submit(complete, "early-pages-1")
                time.sleep(0.3)
                other.proc.send_signal(signal.SIGCONT)
                assert doomed.result().status_code == 500
                assert queued.result().status_code == 200, queued.result().text
            assert metric(gateway, "baton_gateway_prefill_retries_total") == 1
            assert_decode_pools_free([decode])
        finally:
            gateway.terminate()


def test_a_prefill_worker_that_copies_pages_after_their_request_ended_leaves_their_next_request_be(
        tiny_demo_model, tmp_path):
    """The prefill worker stalls between request A's first token and the copy of A's pages; A is cancelled
    meanwhile (as the gateway gives up on a prefill worker that stopped answering): its pages are freed
    and, the only free ones, reserved for request B, written and decoded from. A's copy, once it comes, is
    refused: it would have overwritten B's prompt in the middle of B's stream (B's text changed)."""
    go = tmp_path / "copy-now"
    with processes() as started:
        tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
        prefill = ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "128",
                                 command=failing_step_worker("prefill"), wait=False, env={WRITES_AFTER_ENV: str(go)})
        decode = ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "64", wait=False)
        wait_serving(started, [tokenizer, prefill, decode])
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [prefill.address], [decode.address],
                                 "--local-prefill-max-tokens", "0")
        hog = decode_pb2_grpc.DecodeStub(decode.channel)
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

        def create(prompt: str, request_id: str, max_tokens: int):
            return client.completions.create(model=tiny_demo_model.name, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True},
                                             extra_headers={"x-request-id": request_id})

        decode_metrics = f"http://{metrics_address(decode)}"

        def pages_used() -> float:
            return metric_value(decode_metrics, "baton_kv_pages_used")

        # A's pages (4) outnumber B's prompt's (3): B's reservation lies in them, with room to grow a little.
        prompt_a, prompt_b = "Once upon a time, " * 12, "The quick brown fox jumps. " * 6
        try:
            greedy_b = "".join(chunk.choices[0].text for chunk in create(prompt_b, "b", 200))
            stream_a = create(prompt_a, "late-write-a", 8)
            next(stream_a)
            wait_until(lambda: pages_used() > 0)  # A's reservation, its copy held back
            hog.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=int(64 - pages_used()) * 16 - 1),
                        timeout=5)
            hogged = pages_used()
            assert httpx.post(f"{gateway.base_url}/v1/requests/late-write-a/cancel", timeout=5).status_code == 200
            wait_until(lambda: pages_used() < hogged)
            stream_b = create(prompt_b, "b-on-a-pages", 200)
            text_b = next(stream_b).choices[0].text
            assert hog.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found  # room for B to grow
            go.touch()
            text_b += "".join(chunk.choices[0].text for chunk in stream_b)
            assert [chunk.choices[0].finish_reason for chunk in stream_a][-1] == "abort"
            assert text_b == greedy_b
            assert_decode_pools_free([decode], num_tokens=64 * 16 - 1)
        finally:
            go.touch()
            gateway.terminate()


def test_a_prompt_whose_prefill_worker_goes_away_after_its_first_token_is_prefilled_again_elsewhere(tiny_demo_model):
    """Prefill worker A dies after the first token, its Reserve for the decode worker's pages (all held here
    until then) granted but not yet answered: the prompt and its first token are prefilled again by B for
    the same decode worker, and the stream goes on there, the same greedy text; the pages granted to A are
    freed at once, not when their lease ends. Before, the decode worker was counted as gone, and with no
    other one the stream ended in an error."""
    with processes() as started:
        tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
        doomed, other = (ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "128",
                                        wait=False) for _ in range(2))
        decode = ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", str(DECODE_KV_BLOCKS),
                                "--lease-ms", "120000", wait=False)
        wait_serving(started, [tokenizer, doomed, other, decode])
        other.proc.send_signal(signal.SIGSTOP)  # the gateway sees it only once it answers
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [doomed.address, other.address],
                                 [decode.address], "--local-prefill-max-tokens", "0")
        hog = decode_pb2_grpc.DecodeStub(decode.channel)
        try:
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

            def create():
                return client.completions.create(model=tiny_demo_model.name, prompt="Once upon a time", max_tokens=16,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})

            unmoved = "".join(chunk.choices[0].text for chunk in create())
            hog.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
            stream = create()
            text = next(stream).choices[0].text  # from A, whose Reserve now waits for pages
            other.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: serving(gateway, "prefill") == 2)
            doomed.proc.send_signal(signal.SIGSTOP)
            assert hog.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found
            # A's Reserve granted (its answer unread): its pages are held under the lease of 120 s.
            wait_until(lambda: metric_value(f"http://{metrics_address(decode)}", "baton_kv_reserves_waiting") == 0)
            doomed.proc.send_signal(signal.SIGKILL)
            text += "".join(chunk.choices[0].text for chunk in stream)
            assert text == unmoved
            assert metric(gateway, "baton_gateway_prefill_retries_total") >= 1  # twice if A was routed to again
            assert metric(gateway, "baton_gateway_decode_migrations_total") == 0
            assert_decode_pools_free([decode])
        finally:
            gateway.terminate()


# Streams that go on as if they had never moved: the workers count a moved request's output so far as
# its own (penalties, the guide, the seeded draws), not as prompt.
MOVED_TOKENS = 400
MOVED_STREAMS = {
    "greedy": {},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3},
    "seeded": {"temperature": 1.0, "top_p": 0.95, "seed": 7},
    # min_tokens: the guide would let EOS through after any letter.
    "guided": {"temperature": 0.8, "seed": 3, "extra_body": {"guided_regex": "[a-z ]+", "min_tokens": MOVED_TOKENS}},
}


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_streams_whose_decode_worker_dies_go_on_on_another(tiny_demo_model, layout):
    """Decode worker A is killed mid-stream: each request moves to B (paused until the streams are on
    A), its prompt and output so far prefilled again for B (by a prefill worker, or colocated by B
    itself), and the client reads one whole stream, the same text as the same streams A served to
    their end: greedy, with penalties, seeded sampling, and guided."""
    with processes() as started:
        tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
        prefill = [ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "512", wait=False)
                   for _ in range(layout == "disaggregated")]
        doomed, other = (ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "512", wait=False)
                         for _ in range(2))
        wait_serving(started, [tokenizer, *prefill, doomed, other])
        other.proc.send_signal(signal.SIGSTOP)  # the gateway sees it only once it answers
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [p.address for p in prefill],
                                 [doomed.address, other.address],
                                 *(["--local-prefill-max-tokens", "0"] if prefill else ["--colocated"]))
        try:
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)

            def create(kind: str):
                sampling = {"temperature": 0, **MOVED_STREAMS[kind]}
                extra_body = {"ignore_eos": True, **sampling.pop("extra_body", {})}
                return client.completions.create(model=tiny_demo_model.name, prompt=f"Once upon a time, {kind}",
                                                 max_tokens=MOVED_TOKENS, stream=True, extra_body=extra_body,
                                                 **sampling)

            def read(kind: str) -> str:
                return "".join(chunk.choices[0].text for chunk in create(kind))

            with ThreadPoolExecutor(len(MOVED_STREAMS)) as pool:  # batched, as the moved streams are
                unmoved = dict(zip(MOVED_STREAMS, pool.map(read, MOVED_STREAMS), strict=True))
            streams = {kind: create(kind) for kind in MOVED_STREAMS}
            texts = {kind: next(stream).choices[0].text for kind, stream in streams.items()}  # on A: B is paused
            doomed.proc.send_signal(signal.SIGSTOP)  # mid-stream however long B takes to be routed to
            other.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: serving(gateway, "decode") == 2)
            doomed.proc.send_signal(signal.SIGKILL)
            for kind, stream in streams.items():
                chunks = list(stream)
                texts[kind] += "".join(chunk.choices[0].text for chunk in chunks)
                assert chunks[-1].choices[0].finish_reason == "length", kind
            assert metric(gateway, "baton_gateway_decode_migrations_total") == len(MOVED_STREAMS)
            assert texts == unmoved
            assert re.fullmatch("[a-z ]+", texts["guided"]) and len(set(unmoved.values())) == len(MOVED_STREAMS)
            assert_decode_pools_free([other])
        finally:
            gateway.terminate()


def test_a_request_whose_pages_were_freed_before_its_decode_call_is_prefilled_again(tiny_demo_model):
    """Decode worker A's reservations expire 1 ms after they are made, before the prefill worker's copy into
    their pages (refused: NOT_FOUND) or a Decode call can claim them (NOT_FOUND), as a gateway or prefill
    worker stalled for a whole lease finds them: each request routed to A (every other
    one: ties go in turn) has its prompt and first token prefilled again for B, and the client reads the
    same greedy text as from a request B served from the start, streamed or not; no page stays reserved."""
    with processes() as started:
        tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
        prefill = ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "128", wait=False)
        short_lease, other = (ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks",
                                             str(DECODE_KV_BLOCKS), "--lease-ms", lease_ms, wait=False)
                              for lease_ms in ("1", "10000"))
        wait_serving(started, [tokenizer, prefill, short_lease, other])
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [prefill.address],
                                 [short_lease.address, other.address], "--local-prefill-max-tokens", "0")
        try:
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=30)

            def read(stream: bool) -> str:
                reply = client.completions.create(model=tiny_demo_model.name, prompt="Once upon a time",
                                                  max_tokens=24, temperature=0, stream=stream,
                                                  extra_body={"ignore_eos": True})
                return "".join(chunk.choices[0].text for chunk in reply) if stream else reply.choices[0].text

            texts = [read(stream) for stream in (False, False, True, True)]
            assert len(set(texts)) == 1, texts
            lost = metric(gateway, "baton_gateway_lost_handoffs_total")
            expired = f"http://{metrics_address(short_lease)}"
            errors = httpx.get(f"{expired}/metrics", timeout=5).text
            assert lost >= 1
            def errors_for(reason: str) -> float:
                found = re.search(rf'^baton_request_errors_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$', errors, re.M)
                return float(found.group(1)) if found else 0.0

            assert lost == errors_for("lease_expired") >= errors_for("reservation_not_found")
            assert metric_value(expired, "baton_kv_pages_used") == 0  # a probe's reservation would expire at once
            assert_decode_pools_free([other])
        finally:
            gateway.terminate()


def test_every_service_takes_its_shutdown_grace_by_flag_or_variable(tiny_demo_model):
    from services.decode.config import DecodeServiceConfig
    from services.kvstore.config import KVStoreNodeConfig
    from services.prefill.config import PrefillServiceConfig
    from services.tokenizer.config import TokenizerServiceConfig

    model = ["--model", str(tiny_demo_model)]
    gateway = [*model, "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2", "--decode", "127.0.0.1:3"]
    for config, argv in ((PrefillServiceConfig, model), (DecodeServiceConfig, model), (TokenizerServiceConfig, model),
                         (KVStoreNodeConfig, []), (GatewayConfig, gateway)):
        assert config.from_args(argv, {}).grace_s == 5.0
        assert config.from_args(argv, {"BATON_SHUTDOWN_GRACE_S": "25"}).grace_s == 25.0
        assert config.from_args([*argv, "--shutdown-grace-s", "0.5"], {"BATON_SHUTDOWN_GRACE_S": "25"}).grace_s == 0.5
        with pytest.raises(ConfigError, match="--shutdown-grace-s must be >= 0"):
            config.from_args([*argv, "--shutdown-grace-s", "-1"], {})
        with pytest.raises(ConfigError, match=r"\$BATON_SHUTDOWN_GRACE_S must be a number"):
            config.from_args(argv, {"BATON_SHUTDOWN_GRACE_S": "soon"})


@pytest.mark.parametrize(("grace_s", "num_moved"), [("60", 0), ("0", 1)])
def test_a_decode_worker_told_to_stop_finishes_its_streams_within_its_grace(tiny_demo_model, grace_s, num_moved):
    """SIGTERM: decode worker A takes no new work (its health says NOT_SERVING), and a stream on it goes
    on to its end within --shutdown-grace-s; with none, it is cut and moves to B. Same text either way."""
    with processes() as started:
        tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
        prefill = ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "256", wait=False)
        stopping = ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "256",
                                  "--shutdown-grace-s", grace_s, wait=False)
        other = ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "256", wait=False)
        wait_serving(started, [tokenizer, prefill, stopping, other])
        other.proc.send_signal(signal.SIGSTOP)  # the gateway sees it only once it answers
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [prefill.address],
                                 [stopping.address, other.address], "--local-prefill-max-tokens", "0")
        try:
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
            # Long enough to be mid-stream once B is routed to. (Not paused instead, as A is above: the
            # first token comes from prefill, so a worker paused then may not have read the request yet,
            # and a stopping worker ends such calls: the request moves whatever the grace.)
            kwargs = dict(model=tiny_demo_model.name, prompt="Once upon a time", max_tokens=1000,
                          temperature=0, stream=True, extra_body={"ignore_eos": True})
            alone = "".join(chunk.choices[0].text for chunk in client.completions.create(**kwargs))
            stream = client.completions.create(**kwargs)
            text = next(stream).choices[0].text  # on A: B is still paused
            other.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: serving(gateway, "decode") == 2)
            stopping.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: serving(gateway, "decode") == 1)  # out of routing while it drains
            text += "".join(chunk.choices[0].text for chunk in stream)
            assert text == alone
            assert metric(gateway, "baton_gateway_decode_migrations_total") == num_moved
            assert stopping.proc.wait(timeout=30) == 0
        finally:
            gateway.terminate()


def serving(gateway: GatewayProcess, kind: str) -> float:
    return metric(gateway, f'baton_gateway_workers{{[^}}]*kind="{kind}"[^}}]*state="serving"[^}}]*}}')


def metric(gateway: GatewayProcess, pattern: str) -> float:
    """The value of the gateway's one metric sample matching `pattern` (a regex of its name and labels)."""
    metrics = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    return float(re.search(rf"^{pattern} (\S+)$", metrics, re.M).group(1))


@contextmanager
def processes() -> Iterator[list[ServiceProcess]]:
    """A list of the services a test started, all stopped together at the end (resumed first, if paused)."""
    started: list[ServiceProcess] = []
    try:
        yield started
    finally:
        for svc in started:
            svc.proc.send_signal(signal.SIGCONT)
        stop_processes(started)


def wait_serving(started: list[ServiceProcess], services: list[ServiceProcess]) -> None:
    """`services`, started without waiting, put in `started` (to be stopped at the end) and waited for."""
    started += services
    wait_all_serving(services)
