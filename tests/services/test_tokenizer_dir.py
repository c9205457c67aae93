"""vLLM's --tokenizer: a checkpoint saved without its tokenizer, served with the tokenizer from a directory
of its own (`baton up --tokenizer DIR`, each service's --tokenizer-dir): the same prompts, templates,
stop tokens and context as with the tokenizer beside the weights; a directory without a tokenizer.json
is refused by name."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from services.common.settings import ConfigError
from services.decode.config import DecodeServiceConfig
from services.gateway.config import GatewayConfig
from services.launcher.specs import MeshConfig
from services.prefill.config import PrefillServiceConfig
from services.tokenizer.config import TokenizerServiceConfig
from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.services.test_baton_up import check_up, start_up  # noqa: F401 (a fixture)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def split_model(tiny_demo_model, tmp_path_factory) -> tuple[Path, Path]:
    """The demo model's weights and configs in one directory, its tokenizer in another."""
    root = tmp_path_factory.mktemp("split")
    weights, tokenizer = root / "weights", root / "tokenizer"
    shutil.copytree(tiny_demo_model, weights)
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        shutil.move(weights / name, tokenizer / name)
    return weights, tokenizer


def test_the_tokenizer_read_from_its_own_directory_is_the_models(tiny_demo_model, split_model):
    weights, tokenizer = split_model
    whole, split = ModelTokenizer.from_dir(tiny_demo_model), ModelTokenizer.from_dir(weights, tokenizer_dir=tokenizer)
    assert split.apply_chat_template(MESSAGES) == whole.apply_chat_template(MESSAGES)
    assert split.encode("Name a colour.") == whole.encode("Name a colour.")
    assert (split.eos_token_ids, split.max_model_len) == (whole.eos_token_ids, whole.max_model_len)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        ModelTokenizer.from_dir(weights)
    engine = LLMEngine(EngineConfig(model=str(weights), num_kv_blocks=8, tokenizer=str(tokenizer)))
    assert engine.tokenizer is not None and engine.tokenizer.get_vocab() == whole.tokenizer.get_vocab()


@pytest.mark.parametrize("config", [TokenizerServiceConfig, GatewayConfig, PrefillServiceConfig, DecodeServiceConfig])
def test_every_service_that_reads_the_tokenizer_takes_its_directory(split_model, config):
    weights, tokenizer = split_model
    required = ["--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2", "--decode", "127.0.0.1:3"] \
        if config is GatewayConfig else []
    model = ["--model", str(weights), *required]
    assert config.from_args([*model, "--tokenizer-dir", str(tokenizer)], {}).tokenizer_dir == tokenizer.resolve()
    assert config.from_args(model, {"BATON_TOKENIZER_DIR": str(tokenizer)}).tokenizer_dir == tokenizer.resolve()
    with pytest.raises(ConfigError, match=f"--tokenizer-dir {weights}: no tokenizer.json there"):
        config.from_args([*model, "--tokenizer-dir", str(weights)], {})
    if config in (TokenizerServiceConfig, GatewayConfig):  # the tokenizer is theirs to read
        with pytest.raises(ConfigError, match="no tokenizer.json there"):
            config.from_args(model, {})


def test_baton_up_serves_a_model_with_its_tokenizer_elsewhere(start_up, split_model, tiny_demo_model):  # noqa: F811
    weights, tokenizer = split_model
    with pytest.raises(ValueError, match="give the tokenizer's directory with --tokenizer"):
        MeshConfig(weights)
    up = start_up("--model", str(weights), "--tokenizer", str(tokenizer))
    check_up(up, 1, 1)
    banner = re.search(r"OpenAI API at (\S+)/v1 \(model ([^\s;)]+)", next(l for l in up.stdout if "Baton is up" in l))
    base, model = banner.groups()
    expected = ModelTokenizer.from_dir(tiny_demo_model).apply_chat_template(MESSAGES)[1]
    tokens = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    assert tokens == expected
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == len(expected) and chat["choices"][0]["message"]["content"]
