from __future__ import annotations

import openai
import pytest

from tests.services.gateway.mesh import start_mesh, stop_mesh


@pytest.fixture(scope="package")
def profiler_dir(tmp_path_factory):
    """Where the mesh's workers write torch profiler traces (test_profiling.py)."""
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="package")
def mesh(tiny_demo_model, profiler_dir):
    """One mesh (a tokenizer, 2 prefill, 2 decode, the gateway) for the gateway's end-to-end tests."""
    # Every prompt through a prefill worker and a KV transfer: the path these tests are about.
    # A prompt finding no free pages on its decode worker is refused at once (429) rather than wait for them
    # (test_reserve_wait.py's mesh waits): these tests fill the pools on purpose.
    mesh = start_mesh(tiny_demo_model, num_prefill=2, num_decode=2, gateway_args=("--local-prefill-max-tokens", "0"),
                      worker_args=("--profiler-dir", str(profiler_dir)), prefill_args=("--kv-reserve-wait-s", "0"))
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def client(mesh):
    """The `openai` client of the mesh's OpenAI API; it does not retry."""
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client
