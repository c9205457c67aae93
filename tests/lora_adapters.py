"""LoRA adapters in PEFT's format for tests, made beside a `transformers` model with their delta
merged into a copy of it (what the adapter should compute)."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def make_adapter(where: Path, base, targets, rank: int, alpha: float, rslora: bool, seed: int,
                 layers: str = "model.layers"):
    """A PEFT LoRA adapter on `targets` of every layer that has them (Gemma 4's layers sharing KV have no k or v),
    written to `where`; and `base` with its delta merged. `layers`: where `base` holds them (a multimodal model's
    under its language model)."""
    g = torch.Generator().manual_seed(seed)
    merged, tensors = copy.deepcopy(base), {}
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    for i, layer in enumerate(merged.get_submodule(layers)):
        for target in targets:
            parent, _, leaf = target.rpartition(".")  # (OPT's fc1 and fc2 lie directly under a layer)
            try:
                linear = getattr(layer.get_submodule(parent), leaf, None)
            except AttributeError:  # a layer without the module (MiniMax-M3's full layers have no indexer)
                continue
            if linear is None:
                continue
            a = torch.randn(rank, linear.in_features, generator=g) * 0.3
            b = torch.randn(linear.out_features, rank, generator=g) * 0.3
            tensors[f"base_model.model.{layers}.{i}.{target}.lora_A.weight"] = a
            tensors[f"base_model.model.{layers}.{i}.{target}.lora_B.weight"] = b
            with torch.no_grad():
                linear.weight += scale * b @ a
    where.mkdir(parents=True)
    save_file(tensors, where / "adapter_model.safetensors")
    (where / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora, "bias": "none",
        "target_modules": sorted({t.split(".")[-1] for t in targets}), "task_type": "CAUSAL_LM"}))
    return merged
