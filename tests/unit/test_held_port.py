"""The port `baton up` holds for its kvstore node, whose address the prefill workers are given before it
has started: the node's gRPC server binds it and alone answers on it, and nothing else takes it meanwhile."""
from __future__ import annotations

import asyncio
import socket
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import make_server
from services.launcher.held_port import HeldPort

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="held only on Linux (let go at once elsewhere)")


def plain_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_held_port_is_refused_to_others_and_bound_by_a_grpc_server_that_then_answers_on_it():
    held = HeldPort()
    try:
        assert held.address == f"127.0.0.1:{held.port}"
        assert not plain_bind(held.port)

        async def serve_and_check() -> int:
            server, port = await make_server([], [], address=held.address)
            await server.start()
            try:
                async with grpc.aio.insecure_channel(held.address) as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            finally:
                await server.stop(None)
            return port

        assert asyncio.run(serve_and_check()) == held.port
    finally:
        held.release()


def test_a_released_port_is_free():
    # A port no server used: one that served may be held a while longer by its connections' TIME_WAIT.
    held = HeldPort()
    assert not plain_bind(held.port)
    held.release()
    held.release()  # again: a no-op
    assert plain_bind(held.port)
