"""LoRA adapters in PEFT's format, served beside the base model, as vLLM's `--lora-modules` serves
them: a request names one (`SamplingParams.lora_name`) and its tokens pass through the base
weights plus that adapter's low-rank deltas, scale * (x A^T) B^T, while other requests in the same
batch take other adapters or none.

An adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules) and
`adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]). Adapters on the attention (q, k, v, o) and dense MLP (gate, up, down) projections are
served; one on anything else (embeddings, the LM head, experts), a DoRA adapter, trained biases or
per-module ranks are refused by name rather than served wrong.
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

PEFT_PREFIX = "base_model.model."
# Where a projection's delta goes: (layer, group of fused weights, first row, end row) in the base model.
Target = tuple[int, str, int, int]
# A projection's A and B as this process computes with them: a tensor-parallel rank's share
# (engine/tensor_parallel.py's lora_shard), by the projection's name.
Sharding = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
_loads = itertools.count()


class LoRAError(ValueError):
    pass


@dataclass(frozen=True)
class LoRADelta:
    lo: int  # the rows of the fused weight's output the delta adds to
    hi: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [hi - lo, r], the scale folded in


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    deltas: dict[tuple[int, str], list[LoRADelta]] = field(default_factory=dict)
    # Which read of an adapter this is, in this process: another under the same name (unloaded and loaded
    # again, or read again after eviction) has another; a tensor-parallel rank reads it again on seeing one.
    serial: int = field(default_factory=lambda: next(_loads))

    @classmethod
    def load(cls, name: str, path: str | Path, target_of: Callable[[str], Target | None],
             dtype: torch.dtype, device: torch.device | str = "cpu", sharding: Sharding | None = None,
             placed: Sharding | None = None) -> LoRAAdapter:
        """`target_of`: the model's place for a projection's name (`model.layers.0.self_attn.q_proj`);
        the matrices are kept in `dtype` on `device`, the model's; `sharding`: where the model holds a rank's
        share of its projections, that share of each A and B; `placed`: each A and B as the model holds its
        projection (its rows reordered where the model's are: engine/models/llama.py's `lora_matrices`)."""
        path = Path(path)
        config = _read_config(path)
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights_path = path / "adapter_model.safetensors"
        if not weights_path.is_file():
            raise LoRAError(f"{path}: no adapter_model.safetensors")
        adapter = cls(name, path, rank)
        with safe_open(str(weights_path), framework="pt") as f:
            names = set(f.keys())
            for key in sorted(names):
                if not key.endswith(".lora_A.weight"):
                    if not key.endswith(".lora_B.weight"):
                        raise LoRAError(f"{weights_path}: {key!r} is not a LoRA A or B matrix (trained biases, "
                                        f"embeddings or DoRA magnitudes are not served)")
                    continue
                module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
                target = target_of(module)
                if target is None:
                    raise LoRAError(f"{weights_path}: LoRA on {module!r} is not served (only attention and dense "
                                    f"MLP projections are)")
                b_key = key.removesuffix(".lora_A.weight") + ".lora_B.weight"
                if b_key not in names:
                    raise LoRAError(f"{weights_path}: {key!r} has no {b_key!r}")
                a, b = f.get_tensor(key), f.get_tensor(b_key)
                if placed is not None:
                    a, b = placed(module, a, b)
                if sharding is not None:
                    a, b = sharding(module, a, b)
                adapter._add(target, a, b, rank, scale, module, dtype, device)
        if not adapter.deltas:
            raise LoRAError(f"{weights_path}: no LoRA matrices")
        return adapter

    def _add(self, target: Target, a: torch.Tensor, b: torch.Tensor, rank: int, scale: float, module: str,
             dtype: torch.dtype, device: torch.device | str) -> None:
        layer, group, lo, hi = target
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape != (hi - lo, rank):
            raise LoRAError(f"{self.path}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not make a rank-"
                            f"{rank} delta of its {hi - lo} outputs")
        delta = LoRADelta(lo, hi, a.to(device, dtype).contiguous(), (b.float() * scale).to(device, dtype).contiguous())
        self.deltas.setdefault((layer, group), []).append(delta)


def _read_config(path: Path) -> dict:
    config_path = path / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise LoRAError(f"{path}: no adapter_config.json (not a PEFT LoRA adapter?)") from None
    except json.JSONDecodeError as e:
        raise LoRAError(f"{config_path}: invalid JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{config_path}: peft_type {config['peft_type']!r} is not LORA")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "modules_to_save": "modules_to_save",
               "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas"}
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"{config_path}: {what} ({key}) is not served")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{config_path}: trained biases (bias {config['bias']!r}) are not served")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAError(f"{config_path}: r must be a positive integer, got {config.get('r')!r}")
    return config


class LoRABatch:
    """Which rows of the running step's tokens take which adapter: set by the runner before each
    forward, read by every projection's `LoRAHook`."""

    def __init__(self) -> None:
        self.active: list[tuple[LoRAAdapter, torch.Tensor]] = []  # (adapter, its rows), rows ascending


class LoRAHook:
    """One layer's view of the step's adapters: adds each one's deltas to a projection's output rows."""

    def __init__(self, batch: LoRABatch, layer: int) -> None:
        self.batch = batch
        self.layer = layer

    def add(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` = x W^T of the fused `group`, with each active adapter's deltas added to its rows."""
        for adapter, rows in self.batch.active:
            deltas = adapter.deltas.get((self.layer, group))
            if not deltas:
                continue
            x_rows = x.index_select(0, rows)
            for d in deltas:
                out[:, d.lo:d.hi].index_add_(0, rows, (x_rows @ d.a.T) @ d.b.T)
        return out
