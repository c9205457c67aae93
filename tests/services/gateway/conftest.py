from __future__ import annotations

import pytest

from tests.services.gateway.mesh import start_mesh, stop_mesh


@pytest.fixture(scope="package")
def mesh(tiny_demo_model):
    """One mesh (a tokenizer, 2 prefill, 2 decode, the gateway) for the gateway's end-to-end tests."""
    mesh = start_mesh(tiny_demo_model, num_prefill=2, num_decode=2)
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes
