"""services/common/healthcheck.py, the probe compose.yaml runs in each container:
exit 0 only when the server reports SERVING (or the URL answers 2xx)."""
from __future__ import annotations

import http.server
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.healthcheck import main

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def health_server():
    """A gRPC server with only the health service; yields (address, servicer)."""
    servicer = health.HealthServicer()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def test_serving_exits_0(health_server):
    address, servicer = health_server
    servicer.set("", SERVING)
    assert main([address]) == 0


def test_not_serving_exits_1(health_server, capsys):
    address, servicer = health_server
    servicer.set("", NOT_SERVING)
    assert main([address]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err


def test_checks_the_named_service(health_server):
    address, servicer = health_server
    servicer.set("", SERVING)
    servicer.set("baton.Prefill", NOT_SERVING)
    assert main([address, "--service", "baton.Prefill"]) == 1
    assert main([address, "--service", "unknown"]) == 1


def test_nothing_listening_exits_1_within_the_timeout(capsys):
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert main([f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1
    assert time.monotonic() - start < 5
    assert re.search("UNAVAILABLE|DEADLINE_EXCEEDED", capsys.readouterr().err)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_http_target_needs_2xx():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert main([f"{base}/health"]) == 0
        assert main([f"{base}/other"]) == 1
    finally:
        server.shutdown()
        server.server_close()
