"""4-bit GPTQ and AWQ checkpoints (engine/int4_weights.py): Baton loading the packed numbers, zero
points and scales computes what `transformers` computes from the dequantized weights, logits and
greedy tokens. The checkpoints are packed here one number at a time, as the formats are written
down (AutoGPTQ's rows of eight, AutoAWQ's columns in 0, 2, 4, 6, 1, 3, 5, 7 order), apart from the
engine's vectorized unpacking."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.parity.test_transformers_parity import _check_greedy, _check_logits

GROUP = 32  # input rows a scale and zero point cover: 64 and 160 wide inputs make 2 and 5 groups
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ eight holds, lowest first


def quantized(weight: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as 4-bit numbers q [in, out], zero points [groups, out] and float16 scales
    [groups, out], asymmetric per group of input rows (`groups[i]`: row i's)."""
    w = weight.t().float()
    num_groups = int(groups.max()) + 1
    scales = torch.empty(num_groups, w.shape[1])
    zeros = torch.empty(num_groups, w.shape[1], dtype=torch.int64)
    for g in range(num_groups):
        rows = w[groups == g]
        low, high = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[g] = ((high - low) / 15).clamp(min=1e-6)
        zeros[g] = (-low / scales[g]).round().clamp(0, 15).long()
    scales = scales.half()
    q = (w / scales.float()[groups]).round().long() + zeros[groups]
    return q.clamp(0, 15), zeros, scales


def dequantized(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return ((q - zeros[groups]).float() * scales.float()[groups]).t()


def as_int32(words: list[int]) -> list[int]:
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def packed_down(numbers: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight: eight rows a word, row 8r + j in bits 4j."""
    rows, columns = numbers.shape
    words = [[sum(int(numbers[8 * r + j, c]) << 4 * j for j in range(8)) for c in range(columns)]
             for r in range(rows // 8)]
    return torch.tensor([as_int32(row) for row in words], dtype=torch.int32)


def packed_across(numbers: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Eight columns a word, column 8c + order[j] in bits 4j (GPTQ's zero points: in order)."""
    rows, columns = numbers.shape
    words = [[sum(int(numbers[r, 8 * c + order[j]]) << 4 * j for j in range(8)) for c in range(columns // 8)]
             for r in range(rows)]
    return torch.tensor([as_int32(row) for row in words], dtype=torch.int32)


def int4_checkpoint(source, root, method: str, act_order: bool = False):
    """(the llama model's projections packed as `method`, the same checkpoint with them dequantized)."""
    packed_dir, plain_dir = shutil.copytree(source, root / method), shutil.copytree(source, root / f"{method}-plain")
    tensors = load_file(source / "model.safetensors")
    stored, plain = {}, {}
    torch.manual_seed(7)
    for name, tensor in tensors.items():
        if not name.endswith("_proj.weight"):
            stored[name] = plain[name] = tensor
            continue
        base, num_in = name.removesuffix(".weight"), tensor.shape[1]
        groups = torch.arange(num_in) // GROUP
        if act_order:  # the groups as GPTQ's act-order leaves them: rows of a group anywhere
            groups = groups[torch.randperm(num_in)]
        q, zeros, scales = quantized(tensor, groups)
        plain[name] = dequantized(q, zeros, scales, groups)
        stored[base + ".scales"] = scales
        if method == "gptq":
            stored[base + ".qweight"] = packed_down(q)
            stored[base + ".qzeros"] = packed_across(zeros - 1, tuple(range(8)))  # its first format: one less
            stored[base + ".g_idx"] = groups.int()
            stored[base + ".bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)  # AutoGPTQ stores one
        else:
            stored[base + ".qweight"] = packed_across(q, AWQ_ORDER)
            stored[base + ".qzeros"] = packed_across(zeros, AWQ_ORDER)
    save_file(stored, packed_dir / "model.safetensors")
    save_file(plain, plain_dir / "model.safetensors")
    quantization = ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False}
                    if method == "gptq" else
                    {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"})
    config = json.loads((packed_dir / "config.json").read_text())
    (packed_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    assert not torch.equal(plain["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"])
    return packed_dir, plain_dir


@pytest.mark.parametrize(("method", "act_order"), [("gptq", False), ("gptq", True), ("awq", False)])
def test_a_4bit_checkpoint_computes_its_dequantized_weights(tiny_model_dirs, tmp_path, method, act_order):
    packed_dir, plain_dir = int4_checkpoint(tiny_model_dirs["llama-gqa-untied"], tmp_path, method, act_order)
    _check_logits(packed_dir, reference_dir=plain_dir)
    _check_greedy(packed_dir, max_num_batched_tokens=64, max_new_tokens=16, reference_dir=plain_dir)


def test_a_bias_gptq_stores_for_a_layer_without_one_must_be_zeros(tiny_model_dirs, tmp_path):
    packed_dir, _ = int4_checkpoint(tiny_model_dirs["llama-gqa-untied"], tmp_path, "gptq")
    tensors = load_file(packed_dir / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.bias"][3] = 0.5
    save_file(tensors, packed_dir / "model.safetensors")
    with pytest.raises(Exception, match="k_proj.bias is not zeros"):
        _check_logits(packed_dir, prompt_lengths=(4,))


@pytest.mark.parametrize(("quantization", "named"), [
    ({"quant_method": "gptq", "bits": 8}, "gptq with 8 bits is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "AWQ without zero points"),
    ({"quant_method": "bitsandbytes"}, "quantization 'bitsandbytes' is not supported"),
])
def test_4bit_variants_not_loaded_are_refused_by_name(tiny_model_dirs, tmp_path, quantization, named):
    model_dir = shutil.copytree(tiny_model_dirs["llama-gqa-untied"], tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelConfigError, match=named):
        load_model_config(model_dir)
