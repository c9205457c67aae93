from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_demo_model(tmp_path_factory):
    """A small Llama-architecture directory made by Baton's own demo-model maker."""
    from engine.demo_model import make_demo_model

    path = tmp_path_factory.mktemp("demo") / "tiny"
    return make_demo_model(path, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=1024, seed=1)
