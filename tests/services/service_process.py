"""Starting a real service process in a test: `python -m services.<name>`, its
listening line, health SERVING, and a clean SIGTERM."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.services.preloaded_python import spawn

REPO_ROOT = Path(__file__).resolve().parents[2]



class ServiceProcess:
    """One `python -m services.<name>` process (or `command`, given the same arguments) and a sync
    channel to it. Without `wait`, the process starts and `wait_serving` waits for it: several load
    and warm up at once."""

    def __init__(self, name: str, service_name: str, model_dir: Path | None, *extra_args: str,
                 command: list[str] | None = None, wait: bool = True, env: dict[str, str] | None = None):
        self.name = name
        self.service_name = service_name
        self.channel: grpc.Channel | None = None
        command = command or [sys.executable, "-m", f"services.{name}"]
        model_args = ["--model", str(model_dir)] if model_dir is not None else []  # None: a kvstore node's
        self.proc = spawn([*command, *model_args, "--port", "0", *extra_args],
                          env={**os.environ, **env} if env else None)
        # Read as it comes: a worker that logs more than a pipe holds (64 KiB) would block on its next line.
        self._stderr_lines: list[str] = []
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()
        if wait:
            self.wait_serving()

    def _read_stderr(self) -> None:
        try:
            for line in self.proc.stderr:
                self._stderr_lines.append(line)
        except (OSError, ValueError):  # closed under it once the process is stopped
            pass

    def stderr_text(self, timeout_s: float = 10) -> str:
        """What it has logged; all of it once it has exited (waits up to `timeout_s` for the last lines)."""
        if self.proc.poll() is not None:
            self._stderr_reader.join(timeout_s)
        return "".join(self._stderr_lines)

    def wait_serving(self) -> None:
        try:
            self.address = self._read_listening_line(timeout_s=30)
            self.channel = grpc.insecure_channel(self.address)
            health = health_pb2_grpc.HealthStub(self.channel)
            deadline = time.monotonic() + 30
            while health.Check(health_pb2.HealthCheckRequest(service=self.service_name), timeout=5).status \
                    != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, f"the {self.name} service never reported SERVING"
                time.sleep(0.05)
        except BaseException as e:  # no one holds it to terminate it: it would outlive the tests
            stop_process(self.proc)
            if isinstance(e, grpc.RpcError):  # it stopped answering: what it logged says why
                raise AssertionError(f"the {self.name} service did not come up ({e.code()}); it logged:\n"
                                     f"{self.stderr_text()}") from e
            raise

    def _read_listening_line(self, timeout_s: float) -> str:
        return read_line(self.proc, f"{self.name} listening on ", timeout_s, self.stderr_text)

    def terminate(self) -> int:
        return stop_processes([self])[0]


def read_line(proc: subprocess.Popen, prefix: str, timeout_s: float = 30,
              stderr_text: Callable[[], str] | None = None) -> str:
    """The rest of `proc`'s next stdout line, which must start with `prefix` (else the test fails
    with its stderr, and the process is killed). `stderr_text`: its stderr, where a reader holds it."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not lines or not lines[0].startswith(prefix):
        proc.kill()
        proc.wait()
        pytest.fail(f"expected {prefix!r}, got {lines!r}; stderr:\n"
                    f"{stderr_text() if stderr_text is not None else proc.stderr.read()}")
    return lines[0].removeprefix(prefix).strip()


def metrics_address(svc: ServiceProcess) -> str:
    """The `NAME metrics on HOST:PORT` line, which follows the listening line (read it once)."""
    line = svc.proc.stdout.readline()
    prefix = f"{svc.name} metrics on "
    assert line.startswith(prefix), line
    return line.removeprefix(prefix).strip()


def wait_all_serving(services: list[ServiceProcess]) -> None:
    """Wait for services started without `wait` (loading and warming up at once) until each serves;
    if one does not, every one of them is stopped."""
    try:
        for svc in services:
            svc.wait_serving()
    except BaseException:
        stop_processes(services)
        raise


def stop_processes(services: list[ServiceProcess]) -> list[int]:
    """Stop them all at once (each drains alone: one after another took a mesh's teardown 6.6 s, not 1.6);
    their exit codes."""
    for svc in services:
        if svc.channel is not None:
            svc.channel.close()
        if svc.proc.poll() is None:
            svc.proc.send_signal(signal.SIGTERM)
    return [_exit_code(svc.proc, svc._stderr_reader) for svc in services]


def stop_process(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 15 s; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return _exit_code(proc)


def _exit_code(proc: subprocess.Popen, stderr_reader: threading.Thread | None = None) -> int:
    """Its exit code once it has exited (SIGKILL after 15 s), its pipes closed (once `stderr_reader`
    has read its log to the end)."""
    if proc.returncode is None:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if stderr_reader is not None:
        stderr_reader.join(5)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            try:
                pipe.close()
            except OSError:  # a reader thread may still hold it
                pass
    return proc.returncode


def assert_a_call_opened_ahead_ends_unavailable_at_shutdown(svc: ServiceProcess, open_call) -> None:
    """A worker's gateway keeps a call open to it before it has a request for it (`open_call(channel,
    requests)` opens one); a graceful stop waiting out its grace period (5 s) for such calls would
    make every shutdown that slow, so they end UNAVAILABLE at once."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    with grpc.insecure_channel(svc.address) as channel:  # the helper's own closes with `terminate`
        call = open_call(channel, iter(requests.get, None))
        time.sleep(0.3)
        start = time.monotonic()
        assert svc.terminate() == 0
        assert time.monotonic() - start < 4.0
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        requests.put(None)


# A worker's entry point with a fault injected in this copy of it (nothing makes a real engine fail
# on demand): an engine step fails once a request whose id starts with "fail-" has been added, and
# after SLOW_FAILING_STEP_S once one whose id starts with "slowfail-" has (calls made meanwhile queue
# their engine work behind that step). With RESERVES_ON_ENV naming a decode worker's address, a prefill
# worker adding a request whose id starts with "early-pages-" first reserves 32 tokens' pages there under
# that id, as it does a long prompt's whose first pages it sends before computing the rest (early_pages.py):
# what a prompt leaves behind on its decode worker where its prefill worker goes away before its first token.
# With WRITES_AFTER_ENV naming a file, a prefill worker copies the pages of a request whose id starts with
# "late-write-" only once the file exists: a worker stalled between its first token and its copy.
SLOW_FAILING_STEP_S = 2.0
RESERVES_ON_ENV = "BATON_TEST_RESERVES_ON"
WRITES_AFTER_ENV = "BATON_TEST_WRITES_AFTER"
_FAILING_STEP_WORKER = """
import os
import sys
import time
import services.common.grpc_env  # before grpc, as the worker's own entry point has it
import grpc
from engine.llm_engine import LLMEngine
from protos import decode_pb2, decode_pb2_grpc
from services.common.engine_loop import EngineLoop
step, add_request = LLMEngine.step, LLMEngine.add_request

def failing_step(self):
    if getattr(self, "fail_next_step", None) is not None:
        time.sleep(self.fail_next_step)
        raise RuntimeError("injected: the device fell off the bus")
    return step(self)

def arming_add_request(self, request_id, *args, **kwargs):
    delays = {"fail-": 0.0, "slowfail-": {slow_s}}
    self.fail_next_step = next((s for prefix, s in delays.items() if request_id.startswith(prefix)), None)
    return add_request(self, request_id, *args, **kwargs)

LLMEngine.step, LLMEngine.add_request = failing_step, arming_add_request

# On the event loop, as the call comes: behind a failing step, the engine thread never takes the request.
loop_add_request = EngineLoop.add_request

def reserving_add_request(self, request_id, *args, **kwargs):
    if request_id.startswith("early-pages-") and os.environ.get("{reserves_on_env}"):
        with grpc.insecure_channel(os.environ["{reserves_on_env}"]) as channel:
            decode_pb2_grpc.DecodeStub(channel).Reserve(
                decode_pb2.ReserveRequest(request_id=request_id, num_tokens=32), timeout=5)
    return loop_add_request(self, request_id, *args, **kwargs)

EngineLoop.add_request = reserving_add_request

import asyncio
from services.prefill.kv_writer import KVWriter
kv_write = KVWriter.write

async def late_write(self, transport, request_id, *args, **kwargs):
    if request_id.startswith("late-write-") and os.environ.get("{writes_after_env}"):
        while not os.path.exists(os.environ["{writes_after_env}"]):
            await asyncio.sleep(0.01)
    return await kv_write(self, transport, request_id, *args, **kwargs)

KVWriter.write = late_write
from services.{name}.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def failing_step_worker(name: str) -> list[str]:
    """The command of `python -m services.<name>` (a worker) whose engine fails as said above."""
    return [sys.executable, "-c",
            _FAILING_STEP_WORKER.replace("{name}", name).replace("{slow_s}", str(SLOW_FAILING_STEP_S))
            .replace("{reserves_on_env}", RESERVES_ON_ENV).replace("{writes_after_env}", WRITES_AFTER_ENV)]
