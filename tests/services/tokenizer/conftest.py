from __future__ import annotations

import functools
from pathlib import Path

import pytest

from services.tokenizer.model_tokenizer import ModelTokenizer

# /work/main/tests/services/tokenizer/conftest.py -> /work/shared/models (beside the checkout).
SHARED_MODELS_DIR = Path(__file__).resolve().parents[4] / "shared" / "models"
SHARED_MODEL_NAMES = ("tiny-llama2-spm", "tiny-qwen2.5-bpe")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    from engine.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("tokenizer") / "demo", hidden_size=64, num_layers=2,
                           vocab_size=2048)


def shared_model_dir(name: str) -> Path:
    path = SHARED_MODELS_DIR / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{path} is absent (the shared test models live beside the checkout)")
    return path


@pytest.fixture(params=("demo",) + SHARED_MODEL_NAMES)
def model_dir(request, demo_model_dir) -> Path:
    """Every model with a real tokenizer: the demo model, then the shared ones when present."""
    return demo_model_dir if request.param == "demo" else shared_model_dir(request.param)


# Loading Qwen's 150k-token vocabulary takes a second; tests only read the tokenizers.
@functools.cache
def load_tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)


@functools.cache
def load_hf_tokenizer(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
def tok(model_dir) -> ModelTokenizer:
    return load_tokenizer(model_dir)
