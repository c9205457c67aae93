"""vLLM's and SGLang's /start_profile and /stop_profile on a mesh of 2 prefill and 2 decode workers
(started with --profiler-dir): each worker's trace of the engine steps in between, in Chrome's trace
format, and clear refusals of a second start and of a stop with nothing recording."""
from __future__ import annotations

import json
from pathlib import Path

import httpx


def post(mesh, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", timeout=120, **kwargs)


def test_a_profile_traces_every_workers_steps(mesh, profiler_dir):
    started = post(mesh, "/start_profile", json={"record_shapes": True})
    assert started.status_code == 200, started.text
    assert sorted(w["kind"] for w in started.json()["workers"]) == ["decode", "decode", "prefill", "prefill"]
    again = post(mesh, "/start_profile")
    assert again.status_code == 400 and "recording already" in again.json()["error"]["message"]
    for i in range(8):  # every worker computes some of them
        done = post(mesh, "/v1/completions", json={"model": mesh.model_name, "prompt": f"Profile {i}: a story",
                                                    "max_tokens": 6, "temperature": 0})
        assert done.status_code == 200
    stopped = post(mesh, "/stop_profile")
    assert stopped.status_code == 200, stopped.text
    for worker in stopped.json()["workers"]:
        trace = Path(worker["trace"])
        assert trace.parent == profiler_dir and trace.name.startswith(worker["kind"])
        events = json.loads(trace.read_text())["traceEvents"]
        operators = [e for e in events if e.get("name", "").startswith("aten::")]
        assert operators, f"{worker['kind']} {worker['address']} traced no operator"
        assert any("Input Dims" in e.get("args", {}) for e in operators)  # record_shapes reached it
    nothing = post(mesh, "/stop_profile")
    assert nothing.status_code == 400 and "not recording" in nothing.json()["error"]["message"]
    mesh.assert_decode_pools_free()
