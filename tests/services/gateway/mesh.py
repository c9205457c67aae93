"""A whole mesh for end-to-end tests: the tokenizer, N prefill and M decode workers and
the gateway, each a real `python -m services.<name>` process on 127.0.0.1."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from protos import decode_pb2, decode_pb2_grpc
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from tests.services.preloaded_python import spawn
from tests.services.service_process import (
    ServiceProcess,
    read_line,
    stop_process,
    stop_processes,
    wait_all_serving,
)

DECODE_KV_BLOCKS = 128
BLOCK_SIZE = 16
WHOLE_POOL_TOKENS = DECODE_KV_BLOCKS * BLOCK_SIZE - 1  # the context (2048) refuses one more token


class GatewayProcess:
    """`python -m services.gateway` with its two listening lines (gRPC, then HTTP)."""

    def __init__(self, model_dir: Path, tokenizer: str, prefill: list[str], decode: list[str], *extra_args: str,
                 env: dict[str, str] | None = None):
        self.proc = spawn(
            [sys.executable, "-m", "services.gateway", "--model", str(model_dir), "--tokenizer", tokenizer,
             "--prefill", ",".join(prefill), "--decode", ",".join(decode), "--port", "0", "--http-port", "0",
             *extra_args],
            env={**os.environ, **env} if env else None)
        try:
            self.grpc_address = read_line(self.proc, "gateway listening on ")
            scheme, self.http_address = read_line(self.proc, "gateway ").split(" listening on ")  # http or https
            self.base_url = f"{scheme}://{self.http_address}"
            self.stderr_lines: list[str] = []
            threading.Thread(target=self._drain, daemon=True).start()
            deadline = time.monotonic() + 30
            while httpx.get(f"{self.base_url}/health", timeout=5, verify=False).status_code != 200:
                assert self.proc.poll() is None, "the gateway exited"
                assert time.monotonic() < deadline, "the gateway never became ready"
                time.sleep(0.05)
        except BaseException:  # no one holds it to terminate it: it would outlive the tests
            stop_process(self.proc)
            raise

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def terminate(self) -> int:
        code = stop_process(self.proc)
        if code != 0:  # pytest shows it with the failure: the gateway's log, a hung close's stacks among it
            print("".join(self.stderr_lines[-300:]))
        return code


@dataclass
class Mesh:
    model_dir: Path
    tokenizer: ServiceProcess
    prefill: list[ServiceProcess]
    decode: list[ServiceProcess]
    gateway: GatewayProcess
    extra: list = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    def assert_decode_pools_free(self, within_s: float = 1.0, num_tokens: int = WHOLE_POOL_TOKENS) -> None:
        assert_decode_pools_free(self.decode, within_s, num_tokens)


@contextmanager
def gateway_client(mesh: Mesh, *extra_args: str) -> Iterator[openai.OpenAI]:
    """The `openai` client (no retries) of a second gateway over `mesh`'s workers, started with
    `extra_args`; it must exit cleanly after."""
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], *extra_args)
    try:
        with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            yield client
    finally:
        assert gateway.terminate() == 0


def metric_value(base_url: str, sample_name: str) -> float:
    """A sample of the /metrics at `base_url`, summed over its labels ("baton_gateway_decode_resumes_total")."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == sample_name)


def assert_decode_pools_free(decode: list[ServiceProcess], within_s: float = 1.0,
                             num_tokens: int = WHOLE_POOL_TOKENS) -> None:
    """Reserving every page of every decode worker (`num_tokens`' pages: the default pool's) succeeds
    (retried for `within_s`)."""
    for svc in decode:
        stub = decode_pb2_grpc.DecodeStub(svc.channel)
        deadline = time.monotonic() + within_s
        while True:
            try:
                stub.Reserve(decode_pb2.ReserveRequest(request_id="probe", num_tokens=num_tokens), timeout=5)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert time.monotonic() < deadline, f"{svc.address}: the pool did not become free in time"
                time.sleep(0.02)
        assert stub.Abort(decode_pb2.AbortRequest(request_id="probe"), timeout=5).found


def start_mesh(model_dir: Path, num_prefill: int = 2, num_decode: int = 2, gateway_args: tuple[str, ...] = (),
               worker_args: tuple[str, ...] = (), prefill_args: tuple[str, ...] = (),
               decode_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Mesh:
    """`worker_args` go to prefill and decode workers, `prefill_args` to prefill workers only,
    `decode_args` to decode workers only; `env`, variables set for every process."""
    started: list = []
    try:
        # Started together, waited for in turn: they load and warm up at once.
        tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, model_dir, wait=False, env=env)
        started.append(tokenizer)
        prefill, decode = [], []
        for _ in range(num_prefill):
            prefill.append(ServiceProcess("prefill", PREFILL_SERVICE, model_dir, "--kv-blocks", "128", *worker_args,
                                          *prefill_args, wait=False, env=env))
            started.append(prefill[-1])
        for _ in range(num_decode):
            decode.append(ServiceProcess("decode", DECODE_SERVICE, model_dir, "--kv-blocks", str(DECODE_KV_BLOCKS),
                                         *worker_args, *decode_args, wait=False, env=env))
            started.append(decode[-1])
        wait_all_serving(started)
        gateway = GatewayProcess(model_dir, tokenizer.address, [p.address for p in prefill],
                                 [d.address for d in decode], *gateway_args, env=env)
    except BaseException:
        stop_processes(started)
        raise
    return Mesh(model_dir, tokenizer, prefill, decode, gateway)


@contextmanager
def running_mesh(model_dir: Path, **options: Any) -> Iterator[Mesh]:
    """A mesh started with `start_mesh`'s `options`, stopped after; each process must exit cleanly."""
    mesh = start_mesh(model_dir, **options)
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes


def stop_mesh(mesh: Mesh) -> dict[str, int]:
    """Exit codes by process, gateway first (it stops taking requests before the workers go)."""
    codes = {"gateway": mesh.gateway.terminate()}
    services = [mesh.tokenizer, *mesh.prefill, *mesh.decode]
    for i, (svc, code) in enumerate(zip(services, stop_processes(services), strict=True)):
        codes[f"{svc.name}-{i}"] = code
    return codes


def answer_aborted_while_paused(workers: list[ServiceProcess], request: Callable[[], Any], gateway_url: str,
                                request_id: str) -> Any:
    """`request()`'s answer, made on a thread while `workers` are paused (SIGSTOP) and ended by
    /abort_request naming `request_id` half a second later; it must come within 2 s of the abort,
    the workers still paused (they go on after)."""
    answers = []
    for worker in workers:
        worker.proc.send_signal(signal.SIGSTOP)
    try:
        thread = threading.Thread(target=lambda: answers.append(request()))
        thread.start()
        time.sleep(0.5)  # on its way to a paused worker
        aborted_at = time.monotonic()
        assert httpx.post(f"{gateway_url}/abort_request", json={"rid": request_id}, timeout=10).status_code == 200
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - aborted_at < 2, "the abort waited for the worker"
    finally:
        for worker in workers:
            worker.proc.send_signal(signal.SIGCONT)
    return answers[0]
