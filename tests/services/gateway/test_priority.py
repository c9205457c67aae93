"""vLLM's `priority` through the mesh: workers on the priority scheduling policy take it (the
engine's order is tests/unit/test_engine.py's to check), workers on fcfs refuse any but 0 with a 400
that says why, before anything is generated. SGLang's `/generate` takes its own, larger first."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.services.gateway.mesh import running_mesh


@pytest.fixture(scope="module")
def priority_mesh(tiny_demo_model):
    with running_mesh(tiny_demo_model, num_prefill=1, num_decode=1, worker_args=("--scheduling-policy", "priority"),
                      gateway_args=("--local-prefill-max-tokens", "4")) as mesh:
        yield mesh


@pytest.mark.parametrize("prompt", ["Hi", "Once upon a time there was a prompt long enough for a prefill worker"])
def test_priority_workers_take_a_requests_priority(priority_mesh, prompt):
    """Short prompts prefill on the decode worker, longer ones on the prefill worker: both take it."""
    client = openai.OpenAI(base_url=f"{priority_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0)
    for priority in (-3, 0, 7):
        reply = client.completions.create(model=priority_mesh.model_name, prompt=prompt, max_tokens=4,
                                          extra_body={"priority": priority, "ignore_eos": True})
        assert reply.usage.completion_tokens == 4
    priority_mesh.assert_decode_pools_free()


def test_fcfs_workers_refuse_a_priority(mesh):
    url = f"{mesh.gateway.base_url}/v1/completions"
    body = {"model": mesh.model_name, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url, json={**body, "priority": 0}, timeout=30).status_code == 200
    refused = httpx.post(url, json={**body, "priority": 2}, timeout=30)
    assert refused.status_code == 400, refused.text
    assert "priority scheduling" in refused.json()["error"]["message"]
    assert httpx.post(url, json={**body, "priority": 2**31}, timeout=30).status_code == 400
    mesh.assert_decode_pools_free()


@pytest.fixture(scope="module")
def one_at_a_time(tiny_demo_model):
    """A colocated worker running one sequence at a time: requests that arrive while one runs wait in its
    queue, and go in their priority's order (a prompt handed over by a prefill worker would join the
    running batch at once: its reservation admitted it)."""
    with running_mesh(tiny_demo_model, num_prefill=0, num_decode=1, gateway_args=("--colocated",),
                      worker_args=("--scheduling-policy", "priority", "--max-num-seqs", "1")) as mesh:
        yield mesh


def test_sglangs_priority_schedules_larger_values_first(one_at_a_time):
    url = f"{one_at_a_time.gateway.base_url}/generate"

    def finished_at(max_new_tokens: int, priority: int | None = None) -> float:
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
        reply = httpx.post(url, json=body if priority is None else {**body, "priority": priority}, timeout=60)
        assert reply.status_code == 200, reply.text
        return time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(finished_at, 1500, 10)  # holds the worker's one place (~1 s), preempted by neither
        time.sleep(0.3)
        low = pool.submit(finished_at, 60, 1)  # arrives first: first under fcfs, and under vLLM's order
        time.sleep(0.1)
        high = pool.submit(finished_at, 60, 5)  # tens of ms each: an order no thread switch can turn
        finished = {"running": running.result(), "high": high.result(), "low": low.result()}
        assert sorted(finished, key=finished.get) == ["running", "high", "low"], finished
    refused = httpx.post(url, json={"text": "Hi", "priority": 2**31}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
    one_at_a_time.assert_decode_pools_free()
