"""Starting a real service process in a test: `python -m services.<name>`, its
listening line, health SERVING, and a clean SIGTERM."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServiceProcess:
    """One `python -m services.<name>` process and a sync channel to it."""

    def __init__(self, name: str, service_name: str, model_dir: Path, *extra_args: str):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}", "--model", str(model_dir), "--port", "0", *extra_args],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.address = self._read_listening_line(timeout_s=30)
        self.channel = grpc.insecure_channel(self.address)
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + 30
        while health.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=5).status \
                != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"the {name} service never reported SERVING"
            time.sleep(0.05)

    def _read_listening_line(self, timeout_s: float) -> str:
        prefix = f"{self.name} listening on "
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not lines or not lines[0].startswith(prefix):
            self.proc.kill()
            pytest.fail(f"no listening line (got {lines!r}); stderr:\n{self.proc.stderr.read()}")
        return lines[0].removeprefix(prefix).strip()

    def terminate(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.proc.returncode
