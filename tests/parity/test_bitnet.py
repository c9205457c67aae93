"""BitNet b1.58's ternary checkpoints (engine/bitnet_weights.py, engine/models/bitnet.py) against transformers' BitNet
layers computing them (its integrations/bitnet.py), made from the tiny BitNet of tests/parity/conftest.py: as
microsoft/bitnet-b1.58-2B-4T is released (bitlinear, packed), and as transformers' autobitlinear layers hold them
(ternary with a scale, or full precision made ternary as they load). Its full-precision checkpoint is one of the
generic parity tests' tiny models."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations import bitnet as hf_bitnet
from transformers.utils.quantization_config import BitNetQuantConfig

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.parity.conftest import greedy_outputs
from tests.parity.test_transformers_parity import _engine, _prefill_logits, _random_prompt, transformers

PROJECTIONS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"))


def _ternary_checkpoint(model_dir, tmp_path, linear_class: str, mode: str):
    """The tiny BitNet's projections made ternary (round(w / mean|w|), clipped), stored as `linear_class` in `mode`
    stores them."""
    made = shutil.copytree(model_dir, tmp_path / f"{linear_class}-{mode}")
    tensors = load_file(made / "model.safetensors")
    for name in [n for n in tensors if n.endswith(PROJECTIONS)]:
        weight = tensors[name].float()
        step = weight.abs().mean().clamp(min=1e-5)
        numbers = (weight / step).round().clamp(-1, 1)
        scale = name.removesuffix(".weight") + ".weight_scale"
        if linear_class == "bitlinear":  # packed, the weight the numbers over the scale
            tensors[name], tensors[scale] = hf_bitnet.pack_weights(numbers.clone()), (1 / step).reshape(1)
        elif mode == "offline":  # the numbers, the weight them times the scale
            tensors[name], tensors[scale] = numbers, step.reshape(1)
    save_file(tensors, made / "model.safetensors")
    config = json.loads((made / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "linear_class": linear_class,
                                     "quantization_mode": mode, "modules_to_not_convert": ["lm_head"]}
    (made / "config.json").write_text(json.dumps(config))
    return made


def _transformers_bitnet(model_dir, linear_class: str, mode: str):
    """transformers' BitNet with its quantized layers in place of the linear ones, the checkpoint's tensors in them."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.BitNetForCausalLM(config)
    quantization = BitNetQuantConfig(linear_class=linear_class, quantization_mode=mode)
    hf_bitnet.replace_with_bitnet_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quantization)
    model.load_state_dict(load_file(model_dir / "model.safetensors"), strict=True, assign=True)
    return model.eval()


@pytest.mark.parametrize("linear_class, mode", [("bitlinear", "offline"), ("autobitlinear", "offline"),
                                                ("autobitlinear", "online")])
def test_a_ternary_checkpoint_computes_as_transformers_bitnet_layers(tiny_model_dirs, tmp_path, linear_class, mode):
    """Logits of prompts of 17 and 300 tokens (in chunks of 32) and greedy tokens: a value a half-step from where an
    8-bit rounding turns may turn either way, an eighth of a percent of its token's largest: hence 5e-4, not 1e-4."""
    model_dir = _ternary_checkpoint(tiny_model_dirs["bitnet"], tmp_path, linear_class, mode)
    model = _transformers_bitnet(model_dir, linear_class, mode)
    engine = _engine(model_dir, max_num_batched_tokens=32)
    assert engine.model_config.bitnet.linear_class == linear_class
    with torch._dynamo.config.patch(disable=True):  # (its layers' torch.compile, which computes the same numbers)
        for n in (17, 300):
            prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
            with torch.no_grad():
                expected = model(input_ids=torch.tensor([prompt])).logits[0, -1]
            assert (_prefill_logits(engine, prompt) - expected).abs().max().item() < 5e-4, n
        prompt = _random_prompt(40, engine.model_config.vocab_size, seed=3)
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert greedy_outputs(engine, {"p": (prompt, {})}, 8)["p"] == expected
    engine.close()


@pytest.mark.parametrize("quantization, refused", [
    ({"linear_class": "bitlinear", "quantization_mode": "online"}, "stored quantized"),
    ({"linear_class": "autobitlinear", "use_rms_norm": True}, "use_rms_norm"),
    ({"linear_class": "fp4linear"}, "'fp4linear' in mode 'offline' is not supported"),
])
def test_what_transformers_bitnet_layers_compute_and_baton_does_not_is_refused_by_name(tiny_model_dirs, tmp_path,
                                                                                        quantization, refused):
    model_dir = shutil.copytree(tiny_model_dirs["bitnet"], tmp_path / "bitnet")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitnet",
                                                                                         **quantization}}))
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(model_dir)
    llama = shutil.copytree(tiny_model_dirs["llama-gqa-untied"], tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitnet"}}))
    with pytest.raises(ModelConfigError, match="read for BitNetForCausalLM only"):
        load_model_config(llama)
