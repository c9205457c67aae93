from __future__ import annotations

import pytest

from tests.services.gateway.mesh import start_mesh, stop_mesh


@pytest.fixture(scope="package")
def mesh(tiny_demo_model):
    """A small real mesh (a tokenizer, one prefill and one decode worker, the gateway) to measure."""
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1)
    try:
        yield mesh
    finally:
        codes = stop_mesh(mesh)
    assert all(code == 0 for code in codes.values()), codes
