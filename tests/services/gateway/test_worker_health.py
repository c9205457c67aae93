"""Routing follows the workers' health: a killed worker drops out of routing and serving goes
on; with no worker of a kind left, `/health` and requests say 503. Its own mesh: it kills workers."""
from __future__ import annotations

import signal
import socket
import time

import httpx
import pytest

from services.gateway.workers import expand_addresses
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
