"""Routing follows the workers' health: a killed worker drops out of routing and serving goes
on; with no worker of a kind left, `/health` and requests say 503. Its own mesh: it kills workers.
A pool also follows its name's replicas as they are scaled."""
from __future__ import annotations

import asyncio
import signal
import socket
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2_grpc

from services.common.grpc_server import make_server
from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from services.gateway.workers import WorkerPool, expand_addresses, follow, needs_resolving, resolved_names
from tests.services.gateway.mesh import start_mesh


@pytest.fixture()
def small_mesh(tiny_demo_model):
    mesh = start_mesh(tiny_demo_model, num_prefill=2, num_decode=1)
    try:
        yield mesh
    finally:
        mesh.gateway.terminate()
        for svc in [mesh.tokenizer, *mesh.prefill, *mesh.decode]:
            svc.terminate()


def complete(mesh) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30,
                      json={"model": mesh.model_name, "prompt": "Hello", "max_tokens": 4})


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


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
    wait_for(lambda: httpx.get(f"{mesh.gateway.base_url}/health").status_code == 503)
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
