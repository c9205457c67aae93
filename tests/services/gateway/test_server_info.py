"""SGLang's GET /get_server_info (and /server_info) and /get_load, and vLLM's /load, on a mesh of 2 prefill and 2 decode
workers: the mesh's limits as SGLang names them, from what each worker's scheduler reports, and its
state and load now."""
from __future__ import annotations

import httpx

from tests.services.gateway.mesh import BLOCK_SIZE, DECODE_KV_BLOCKS
from tests.services.gateway.test_generation_pause import StreamedSample, pause, resume


def server_info(mesh) -> dict:
    answer = httpx.get(f"{mesh.gateway.base_url}/get_server_info", timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_mesh_reports_its_workers_limits_as_sglang_names_them(mesh):
    info = server_info(mesh)
    states = info["internal_states"]
    assert sorted(s["kind"] for s in states) == ["decode", "decode", "prefill", "prefill"]
    assert {s["address"] for s in states} == {p.address for p in [*mesh.prefill, *mesh.decode]}
    assert all("error" not in s and s["is_serving"] and not s["is_paused"] for s in states), states
    decode_tokens = DECODE_KV_BLOCKS * BLOCK_SIZE
    assert [s["max_total_num_tokens"] for s in states if s["kind"] == "decode"] == [decode_tokens] * 2
    assert info["max_total_num_tokens"] == 2 * decode_tokens
    assert info["max_running_requests"] == sum(s["max_running_requests"] for s in states if s["kind"] == "decode")
    assert info["page_size"] == BLOCK_SIZE and info["context_length"] == 2048
    assert info["model_path"] == mesh.model_name and info["disaggregation_mode"] == "prefill-decode"
    assert info["weight_version"] == "default" and info["generation_paused"] is None
    assert "avg_spec_accept_length" not in states[0] and "speculative_algorithm" not in states[0]  # none here
    assert httpx.get(f"{mesh.gateway.base_url}/server_info", timeout=10).json().keys() == info.keys()


def test_a_paused_mesh_reports_its_workers_paused_and_the_pages_its_requests_hold(mesh):
    sample = StreamedSample(mesh)
    try:
        sample.wait_for_tokens(8)
        assert pause(mesh, mode="in_place").status_code == 200
        info = server_info(mesh)
        assert info["generation_paused"] == "in_place"
        assert all(s["is_paused"] for s in info["internal_states"])
        [holding] = [s for s in info["internal_states"] if s["kind"] == "decode" and s["num_running_reqs"]]
        assert holding["num_free_tokens"] < holding["max_total_num_tokens"]
        loads = httpx.get(f"{mesh.gateway.base_url}/get_load", timeout=10).json()  # SGLang's load probe
        assert [load["dp_rank"] for load in loads] == list(range(4))
        [busy] = [load for load in loads if load["num_reqs"]]
        assert busy["address"] == holding["address"] and busy["num_waiting_reqs"] == 0
        assert busy["num_tokens"] == holding["max_total_num_tokens"] - holding["num_free_tokens"]
        assert httpx.get(f"{mesh.gateway.base_url}/load", timeout=10).json() == {"server_load": 1}  # vLLM's
    finally:
        assert resume(mesh).status_code == 200
    sample.join()
    assert not any(s["is_paused"] for s in server_info(mesh)["internal_states"])
    assert httpx.get(f"{mesh.gateway.base_url}/load", timeout=10).json() == {"server_load": 0}
    mesh.assert_decode_pools_free()
