"""compressed-tensors' pack-quantized checkpoints (llm-compressor's W4A16 and W8A16 exports; engine/int4_weights.py):
Baton loading the packed numbers, scales and zero points computes what `transformers` computes from the
dequantized weights, logits and greedy tokens. The numbers are packed here one at a time, as the format is
written down (each row's numbers along the input dimension, as many a word as fit, lowest bits first, offset to
unsigned; zero points packed down the output dimension), apart from the engine's vectorized unpacking."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.parity.test_int4_checkpoints import as_int32
from tests.parity.test_transformers_parity import _check_greedy, _check_logits

GROUP = 32  # input columns a scale covers: 64 and 160 wide inputs make 2 and 5 groups


def quantized(weight: torch.Tensor, bits: int, groups: torch.Tensor, symmetric: bool):
    """`weight` [out, in] as signed `bits`-bit numbers q [out, in], float16 scales [out, groups] and signed zero
    points [out, groups] (None where symmetric), each group of input columns (`groups[i]`: column i's) its own."""
    w, top = weight.float(), (1 << (bits - 1)) - 1
    num_groups = int(groups.max()) + 1
    scales = torch.empty(w.shape[0], num_groups)
    zeros = torch.zeros(w.shape[0], num_groups, dtype=torch.int64)
    for g in range(num_groups):
        columns = w[:, groups == g]
        if symmetric:
            scales[:, g] = (columns.abs().max(1).values / top).clamp(min=1e-6)
        else:
            low, high = columns.min(1).values.clamp(max=0), columns.max(1).values.clamp(min=0)
            scales[:, g] = ((high - low) / (2 * top + 1)).clamp(min=1e-6)
            zeros[:, g] = (-low / scales[:, g]).round().long() - top - 1
    scales = scales.half()
    q = (w / scales.float()[:, groups]).round().long() + zeros[:, groups]
    return q.clamp(-top - 1, top), scales, (None if symmetric else zeros)


def packed_along_rows(numbers: torch.Tensor, bits: int) -> torch.Tensor:
    """Each row's numbers [rows, n], 32 / bits a word, the lowest bits first, offset by 2 ** (bits - 1)."""
    per_word, offset = 32 // bits, 1 << (bits - 1)
    rows, n = numbers.shape
    words = [[sum((int(numbers[r, per_word * c + j]) + offset) << bits * j
                  for j in range(per_word) if per_word * c + j < n) for c in range(-(-n // per_word))]
             for r in range(rows)]
    return torch.tensor([as_int32(row) for row in words], dtype=torch.int32)


def pack_quantized_checkpoint(source, root, bits: int, strategy: str, symmetric: bool, actorder: bool = False):
    """(`source`'s projections, experts' too, packed, the same checkpoint with them dequantized)."""
    name = f"w{bits}-{strategy}-{'sym' if symmetric else 'asym'}{'-actorder' if actorder else ''}"
    packed_dir, plain_dir = shutil.copytree(source, root / name), shutil.copytree(source, root / f"{name}-plain")
    tensors = load_file(source / "model.safetensors")
    stored, plain = {}, {}
    torch.manual_seed(bits)
    for key, tensor in tensors.items():
        if not key.endswith("_proj.weight"):
            stored[key] = plain[key] = tensor
            continue
        num_in = tensor.shape[1]
        groups = torch.arange(num_in) // GROUP if strategy == "group" else torch.zeros(num_in, dtype=torch.long)
        if actorder:  # the groups as GPTQ's activation order leaves them: columns of a group anywhere
            groups = groups[torch.randperm(num_in)]
            stored[key + "_g_idx"] = groups.int()
        q, scales, zeros = quantized(tensor, bits, groups, symmetric)
        plain[key] = ((q - (0 if zeros is None else zeros[:, groups])).float() * scales.float()[:, groups])
        stored |= {key + "_packed": packed_along_rows(q, bits), key + "_scale": scales,
                   key + "_shape": torch.tensor(tensor.shape)}
        if zeros is not None:  # packed down the output dimension
            stored[key + "_zero_point"] = packed_along_rows(zeros.t(), bits).t().contiguous()
    save_file(stored, packed_dir / "model.safetensors")
    save_file(plain, plain_dir / "model.safetensors")
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": GROUP if strategy == "group" else None, "dynamic": False,
               "actorder": "group" if actorder else None}
    quantization = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                    "quantization_status": "compressed",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                  "input_activations": None, "output_activations": None}}}
    config = json.loads((packed_dir / "config.json").read_text())
    (packed_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return packed_dir, plain_dir


@pytest.mark.parametrize(("bits", "strategy", "symmetric", "actorder"), [
    (4, "group", True, False),  # llm-compressor's W4A16
    (4, "group", False, False),
    (4, "group", True, True),
    (8, "channel", True, False),  # its W8A16
    (8, "group", False, False),
])
def test_a_pack_quantized_checkpoint_computes_its_dequantized_weights(tiny_model_dirs, tmp_path, bits, strategy,
                                                                      symmetric, actorder):
    packed_dir, plain_dir = pack_quantized_checkpoint(tiny_model_dirs["llama-gqa-untied"], tmp_path, bits, strategy,
                                                      symmetric, actorder)
    _check_logits(packed_dir, reference_dir=plain_dir)
    _check_greedy(packed_dir, max_num_batched_tokens=64, max_new_tokens=16, reference_dir=plain_dir)


def test_a_mixture_of_experts_quantized_expert_by_expert(tiny_model_dirs, tmp_path):
    packed_dir, plain_dir = pack_quantized_checkpoint(tiny_model_dirs["qwen3-moe"], tmp_path, 4, "group", True)
    assert "model.layers.0.mlp.experts.3.down_proj.weight_packed" in load_file(packed_dir / "model.safetensors")
    _check_logits(packed_dir, reference_dir=plain_dir)


@pytest.mark.parametrize(("weights", "activations", "named"), [
    ({"num_bits": 2, "type": "int", "strategy": "group", "group_size": 32}, None, "2-bit int"),
    ({"num_bits": 4, "type": "int", "strategy": "tensor"}, None, "strategy 'tensor'"),
    ({"num_bits": 8, "type": "int", "strategy": "channel"}, {"num_bits": 8, "type": "int", "dynamic": True},
     "quantized activations"),
    (None, None, "without config_groups"),
])
def test_variants_not_loaded_are_refused_by_name(tiny_model_dirs, tmp_path, weights, activations, named):
    model_dir = shutil.copytree(tiny_model_dirs["llama-gqa-untied"], tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    quantization = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "config_groups": {"group_0": {"weights": weights, "input_activations": activations}}
                    if weights else {}}
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelConfigError, match=named):
        load_model_config(model_dir)
