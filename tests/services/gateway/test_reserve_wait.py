"""A prompt whose decode worker has no free pages waits for them, queued there, as it would
in vLLM's or SGLang's queue, rather than fail: its first token comes, then the rest once
running requests free pages. A client that leaves meanwhile takes its place out of the queue.
(The package's shared mesh runs with --kv-reserve-wait-s 0: its tests of a full pool want
the 429 at once.)"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import decode_pb2, decode_pb2_grpc
from tests.services.gateway.mesh import WHOLE_POOL_TOKENS, start_mesh, stop_mesh
from tests.services.service_process import metrics_address


@pytest.fixture(scope="module")
def waiting_mesh(tiny_demo_model):
    """A tokenizer, a prefill and a decode worker and the gateway, the prefill worker waiting as long as
    it does by default for the decode worker's pages."""
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1, gateway_args=("--local-prefill-max-tokens", "0"))
    mesh.decode_metrics = f"http://{metrics_address(mesh.decode[0])}/metrics"
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes


def reserves_waiting(mesh) -> float:
    text = httpx.get(mesh.decode_metrics, timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "baton_kv_reserves_waiting")


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Hog:
    """Every page of the mesh's decode worker reserved, as running requests would hold them."""

    def __init__(self, mesh) -> None:
        self.stub = decode_pb2_grpc.DecodeStub(mesh.decode[0].channel)
        self.stub.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)

    def release(self) -> None:
        self.stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5)


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
