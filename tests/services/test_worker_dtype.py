"""--dtype and --device of prefill and decode workers: read from the flag or the shared variable, checked
by name (baton up passes --dtype to both; tests/services/test_baton_up.py serves a bfloat16 mesh; workers on
a CUDA device: tests/services/test_cuda_workers.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.common.settings import ConfigError, resolved_dtype
from services.decode.config import DecodeServiceConfig
from services.prefill.config import PrefillServiceConfig


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_dtype_comes_from_the_flag_or_the_shared_variable(config, tiny_demo_model):
    model = ["--model", str(tiny_demo_model)]
    assert config.from_args(model, {}).dtype == "float32"
    assert config.from_args(model, {"BATON_DTYPE": "bfloat16"}).dtype == "bfloat16"
    assert config.from_args([*model, "--dtype", "float16"], {"BATON_DTYPE": "bfloat16"}).dtype == "float16"
    with pytest.raises(ConfigError, match="--dtype must be one of float32, bfloat16, float16 or auto, got 'int8'"):
        config.from_args([*model, "--dtype", "int8"], {})


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_auto_is_the_checkpoints_own_dtype(config, tiny_demo_model, tmp_path):
    model = shutil.copytree(tiny_demo_model, tmp_path / "model")
    assert config.from_args(["--model", str(model), "--dtype", "auto"], {}).dtype == "float32"
    for stored, computed in (("bfloat16", "bfloat16"), ("float16", "float16"), ("float64", "float32")):
        settings = json.loads((model / "config.json").read_text())
        settings.update(torch_dtype=stored, dtype=stored)
        (model / "config.json").write_text(json.dumps(settings))
        assert config.from_args(["--model", str(model)], {"BATON_DTYPE": "auto"}).dtype == computed
        # No --dtype: float32 on the CPU (the fast one there), the checkpoint's own on a GPU (vLLM's default).
        assert config.from_args(["--model", str(model), "--device", "cpu"], {}).dtype == "float32"
        assert resolved_dtype(None, model, device="cuda:0") == computed


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_kv_cache_dtype_comes_from_the_flag_or_the_shared_variable(config, tiny_demo_model):
    model = ["--model", str(tiny_demo_model)]
    assert config.from_args(model, {}).kv_cache_dtype == "auto"
    assert config.from_args(model, {"BATON_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    assert config.from_args([*model, "--kv-cache-dtype", "fp8_e5m2"], {}).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int4'"):
        config.from_args([*model, "--kv-cache-dtype", "int4"], {})


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_device_is_the_cpu_or_a_cuda_device_torch_sees(config, tiny_demo_model):
    model = ["--model", str(tiny_demo_model)]
    has_cuda = torch.cuda.is_available()
    assert config.from_args(model, {}).device == ("cuda:0" if has_cuda else "cpu")
    assert config.from_args(model, {"BATON_DEVICE": "cpu"}).device == "cpu"
    assert config.from_args([*model, "--device", "cpu"], {"BATON_DEVICE": "cuda"}).device == "cpu"
    with pytest.raises(ConfigError, match="--device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        config.from_args([*model, "--device", "tpu"], {})
    if has_cuda:
        assert config.from_args([*model, "--device", "cuda"], {}).device == "cuda:0"
        with pytest.raises(ConfigError, match=r"--device cuda:99: torch sees \d+ CUDA device"):
            config.from_args([*model, "--device", "cuda:99"], {})
    else:
        with pytest.raises(ConfigError, match="--device cuda: torch sees no CUDA device here"):
            config.from_args([*model], {"BATON_DEVICE": "cuda"})
