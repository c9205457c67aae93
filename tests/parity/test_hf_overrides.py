"""vLLM's --hf-overrides: config.json keys replaced for every reader of it. The engine computes as
transformers does from a config.json holding the same keys (a RoPE scaling, a longer context),
names its KV otherwise (workers that disagree refuse each other's pages), and the services take the
overrides by flag or by the variable the mesh shares, refusing what is not a JSON object."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.checkpoint import kv_fingerprint
from services.common.settings import ConfigError
from services.decode.config import DecodeServiceConfig
from services.gateway.config import GatewayConfig
from services.prefill.config import PrefillServiceConfig
from services.tokenizer.config import TokenizerServiceConfig
from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.parity.test_transformers_parity import _check_greedy, _check_logits

OVERRIDES = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "max_position_embeddings": 4096}


def test_the_engine_computes_as_transformers_does_with_the_keys_in_config_json(tiny_model_dirs, tmp_path):
    source = tiny_model_dirs["qwen2-bias"]
    reference = shutil.copytree(source, tmp_path / "overridden")
    config = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**config, **OVERRIDES}))
    _check_logits(source, reference_dir=reference, hf_overrides=OVERRIDES)
    with pytest.raises(AssertionError, match="max \\|logit diff\\|"):  # the overrides make the difference
        _check_logits(source, reference_dir=reference)


def test_the_kv_fingerprint_and_the_context_follow_the_overrides(tiny_demo_model):
    plain, overridden = kv_fingerprint(tiny_demo_model, None), kv_fingerprint(tiny_demo_model, None, OVERRIDES)
    assert plain != overridden == kv_fingerprint(tiny_demo_model, None, dict(reversed(OVERRIDES.items())))
    assert ModelTokenizer.from_dir(tiny_demo_model, hf_overrides=OVERRIDES).max_model_len == 4096


def test_every_service_takes_the_overrides_by_flag_or_the_shared_variable(tiny_demo_model):
    given = json.dumps(OVERRIDES)
    model = ["--model", str(tiny_demo_model)]
    gateway = [*model, "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2", "--decode", "127.0.0.1:3"]
    for config, args in ((TokenizerServiceConfig, model), (PrefillServiceConfig, model),
                         (DecodeServiceConfig, model), (GatewayConfig, gateway)):
        assert config.from_args(args, {}).hf_overrides is None
        assert config.from_args([*args, "--hf-overrides", given], {}).hf_overrides == OVERRIDES
        assert config.from_args(args, {"BATON_HF_OVERRIDES": given}).hf_overrides == OVERRIDES
        with pytest.raises(ConfigError, match="--hf-overrides .* must be a JSON object"):
            config.from_args([*args, "--hf-overrides", "[1, 2]"], {})
        with pytest.raises(ConfigError, match="--hf-overrides .* is not JSON"):
            config.from_args(args, {"BATON_HF_OVERRIDES": "{rope"})


def test_dtype_auto_reads_the_overrides_torch_dtype(tiny_demo_model):
    args = ["--model", str(tiny_demo_model), "--dtype", "auto"]
    assert PrefillServiceConfig.from_args(args, {}).dtype == "float32"
    overridden = [*args, "--hf-overrides", '{"torch_dtype": "bfloat16"}']
    assert PrefillServiceConfig.from_args(overridden, {}).dtype == DecodeServiceConfig.from_args(overridden, {}).dtype \
        == "bfloat16"


def test_greedy_tokens_follow_the_overrides(tiny_model_dirs, tmp_path):
    source = tiny_model_dirs["llama-gqa-untied"]
    reference = shutil.copytree(source, tmp_path / "overridden")
    config = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**config, **OVERRIDES}))
    _check_greedy(source, max_num_batched_tokens=64, max_new_tokens=16, reference_dir=reference,
                  hf_overrides=OVERRIDES)


def test_baton_up_refuses_overrides_that_are_no_json_object_before_starting_anything(tiny_demo_model):
    from services.launcher.specs import MeshConfig

    assert MeshConfig(tiny_demo_model, hf_overrides=json.dumps(OVERRIDES)).hf_overrides == json.dumps(OVERRIDES)
    with pytest.raises(ValueError, match="--hf-overrides .* must be a JSON object"):
        MeshConfig(tiny_demo_model, hf_overrides="[1]")
