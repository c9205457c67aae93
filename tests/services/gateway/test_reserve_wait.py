"""A prompt whose decode worker has no free pages waits for them, queued there, as it would
in vLLM's or SGLang's queue, rather than fail: its first token comes, then the rest once
running requests free pages. A client that leaves meanwhile takes its place out of the queue;
a decode worker told to stop sends its waiting prompts to another at once.
(The package's shared mesh runs with --kv-reserve-wait-s 0: its tests of a full pool want
the 429 at once.)"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import decode_pb2, decode_pb2_grpc
from tests.services.gateway.mesh import (
    WHOLE_POOL_TOKENS,
    assert_decode_pools_free,
    metric_value,
    start_mesh,
    stop_mesh,
)
from tests.services.service_process import metrics_address
from tests.services.waiting import wait_until


@pytest.fixture(scope="module")
def waiting_mesh(tiny_demo_model):
    """A tokenizer, a prefill and two decode workers and the gateway, the prefill worker waiting as long
    as it does by default for the decode workers' pages. The last test stops a decode worker."""
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=2, gateway_args=("--local-prefill-max-tokens", "0"))
    mesh.decode_metrics = [f"http://{metrics_address(decode)}/metrics" for decode in mesh.decode]
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes


def reserves_waiting(mesh, worker: int | None = None) -> float:
    """Reserve calls waiting on decode worker `worker` (None: on any)."""
    urls = mesh.decode_metrics if worker is None else [mesh.decode_metrics[worker]]
    texts = [httpx.get(url, timeout=10).text for url in urls]
    return sum(sample.value for text in texts for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "baton_kv_reserves_waiting")


class Hog:
    """Every page of every decode worker of the mesh reserved, as running requests would hold them."""

    def __init__(self, mesh) -> None:
        self.stubs = [decode_pb2_grpc.DecodeStub(decode.channel) for decode in mesh.decode]
        for stub in self.stubs:
            stub.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)

    def release(self, worker: int | None = None) -> None:
        for stub in self.stubs if worker is None else [self.stubs[worker]]:
            stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5)


def completion(mesh, stream: bool) -> dict:
    return {"model": mesh.model_name, "prompt": "waiting for pages", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # ignore_eos: a first token that ends it would need no pages


def test_prompts_wait_for_decode_pages_and_finish_once_they_free(waiting_mesh):
    mesh = waiting_mesh
    hog = Hog(mesh)
    try:
        whole: dict = {}
        not_streamed = threading.Thread(target=lambda: whole.update(httpx.post(
            f"{mesh.gateway.base_url}/v1/completions", json=completion(mesh, stream=False), timeout=60).json()))
        not_streamed.start()
        with httpx.stream("POST", f"{mesh.gateway.base_url}/v1/completions", json=completion(mesh, stream=True),
                          timeout=60) as response:
            assert response.status_code == 200
            lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines))  # the first token needs no pages on the decode worker
            assert first["choices"][0]["text"] and "error" not in first
            wait_until(lambda: reserves_waiting(mesh) == 2)  # both prompts queued there for pages
            assert not_streamed.is_alive()
            hog.release()
            rest = list(lines)
        not_streamed.join(30)
    finally:
        hog.release()
    assert rest[-1] == "[DONE]"
    chunks = [first, *map(json.loads, rest[:-1])]
    assert not any("error" in chunk for chunk in chunks), chunks
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 4, whole
    assert reserves_waiting(mesh) == 0
    mesh.assert_decode_pools_free()


def test_a_client_that_leaves_while_its_prompt_waits_for_pages_leaves_the_queue(waiting_mesh):
    mesh = waiting_mesh
    hog = Hog(mesh)
    try:
        with httpx.stream("POST", f"{mesh.gateway.base_url}/v1/completions", json=completion(mesh, stream=True),
                          timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # held: an iterator let go of closes the stream
            next(line for line in lines if line.startswith("data: "))
            wait_until(lambda: reserves_waiting(mesh) == 1)
        # Gone: the gateway cancels its prefill call, which cancels the Reserve waiting on the decode worker.
        wait_until(lambda: reserves_waiting(mesh) == 0, timeout_s=1.0)
    finally:
        hog.release()
    mesh.assert_decode_pools_free(within_s=0.5)  # the pages went to nobody


def test_a_request_cancelled_while_its_kv_is_handed_over_ends_aborted_at_once(waiting_mesh):
    """Its first token out, its prompt waiting for pages: the decode worker has nothing of it to abort, so
    the cancel stops the handoff (it was lost, and the request ran on once pages came)."""
    mesh = waiting_mesh
    hog = Hog(mesh)
    try:
        with httpx.stream("POST", f"{mesh.gateway.base_url}/v1/completions", json=completion(mesh, stream=True),
                          headers={"x-request-id": "handed-over"}, timeout=10) as response:
            lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines))
            wait_until(lambda: reserves_waiting(mesh) == 1)
            cancelled = httpx.post(f"{mesh.gateway.base_url}/v1/requests/handed-over/cancel", timeout=10)
            assert cancelled.status_code == 200, cancelled.text
            rest = list(lines)  # at once: the pages it waits for never come in this test
        wait_until(lambda: reserves_waiting(mesh) == 0, timeout_s=1.0)
    finally:
        hog.release()
    assert rest[-1] == "[DONE]"
    chunks = [first, *map(json.loads, rest[:-1])]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "abort"
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == first["choices"][0]["text"]
    mesh.assert_decode_pools_free()


def test_a_decode_worker_told_to_stop_sends_the_prompts_waiting_for_its_pages_to_another(waiting_mesh):
    mesh = waiting_mesh
    hog = Hog(mesh)
    answer: dict = {}
    try:
        asking = threading.Thread(target=lambda: answer.update(response=httpx.post(
            f"{mesh.gateway.base_url}/v1/completions", json=completion(mesh, stream=False), timeout=60)))
        asking.start()
        wait_until(lambda: reserves_waiting(mesh) == 1)
        stopped = 0 if reserves_waiting(mesh, 0) == 1 else 1
        hog.release(1 - stopped)  # room on the other
        signaled = time.monotonic()
        mesh.decode[stopped].proc.send_signal(signal.SIGTERM)  # its grace (5 s) would hold the prompt
        asking.join(30)
        answered_s = time.monotonic() - signaled
    finally:
        hog.release(1 - stopped)
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert answered_s < 2.0
    # The prefill worker's UNAVAILABLE was the decode worker's, handed on: no prefill worker went away.
    assert metric_value(mesh.gateway.base_url, "baton_gateway_prefill_retries_total") == 0
    assert metric_value(mesh.gateway.base_url, "baton_gateway_decode_migrations_total") == 1
    assert mesh.decode[stopped].proc.wait(timeout=30) == 0
    assert_decode_pools_free([mesh.decode[1 - stopped]])
