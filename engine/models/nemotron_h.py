"""NVIDIA Nemotron-H (NemotronHForCausalLM: Nemotron-H 8B/47B, Nemotron Nano 9B v2 and 12B v2, Nemotron 3): a stack of
blocks, each one mixer behind an RMS norm with the residual around it — a Mamba-2 layer (engine/models/mamba2.py),
attention without positions (no RoPE: the Mamba-2 layers before it carry order), an MLP of squared ReLU without a
gate, or (Nemotron 3's) experts of that MLP's kind routed as DeepSeek-V3's, beside a shared one.
Its attention layers alone have pages; its Mamba-2 layers keep states (engine/models/hybrid.py). Its checkpoints as
released name the model `backbone.` (read as `model.`: engine/model_runner.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora import LoRAHook, Target
from engine.mamba_config import ATTENTION, MAMBA, MOE
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import Attention
from engine.models.mamba2 import Mamba2Mixer
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class SquaredReLUMLP(nn.Module):
    takes_lora = True  # the step's adapters on its projections up and down, where its model serves them
    lora: LoRAHook | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, width: int | None = None) -> None:
        super().__init__()
        self.linear = kernels.linear
        width = width or config.intermediate_size
        self.up_weight = empty_param(width, config.hidden_size, dtype=dtype)
        self.down_weight = empty_param(config.hidden_size, width, dtype=dtype)
        self.up_bias = empty_param(width, dtype=dtype) if config.mlp_bias else None
        self.down_bias = empty_param(config.hidden_size, dtype=dtype) if config.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.linear(x, self.up_weight, self.up_bias)
        if self.lora is not None:
            self.lora.add("up", x, up)
        activated = F.relu(up).square()
        out = self.linear(activated, self.down_weight, self.down_bias)
        return out if self.lora is None else self.lora.add("down", activated, out)


class SquaredReLUExperts(nn.Module):
    """Nemotron 3's experts: chosen by sigmoid score plus a correction bias within the best groups, weighed by their
    scores (renormalized, scaled), as DeepSeek-V3's (SparseMoE's router); each an MLP of squared ReLU without a gate,
    in a narrower latent width where the model has one; a shared MLP of that kind beside them."""

    route = SparseMoE._route_by_groups

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear, self.moe = kernels.linear, config.moe
        moe = config.moe
        hidden, inter = config.hidden_size, moe.moe_intermediate_size
        width = moe.latent_size or hidden
        self.router_weight = empty_param(moe.num_experts, hidden, dtype=torch.float32)
        self.router_bias = empty_param(moe.num_experts, dtype=torch.float32)
        self.up_weight = empty_param(moe.num_experts, inter, width, dtype=dtype)
        self.down_weight = empty_param(moe.num_experts, width, inter, dtype=dtype)
        self.latent_in = empty_param(width, hidden, dtype=dtype) if moe.latent_size else None
        self.latent_out = empty_param(hidden, width, dtype=dtype) if moe.latent_size else None
        self.shared = SquaredReLUMLP(config, kernels, dtype, moe.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)  # [T, k] each, the weights float32
        h = x if self.latent_in is None else self.linear(x, self.latent_in)
        out = torch.zeros(h.shape, dtype=weights.dtype, device=x.device)
        for expert in experts.unique().tolist():  # ascending, as transformers sums them
            tokens, slot = torch.where(experts == expert)
            up = F.relu(self.linear(h[tokens], self.up_weight[expert])).square()
            made = self.linear(up, self.down_weight[expert])
            out.index_add_(0, tokens, made * weights[tokens, slot, None])
        out = out.to(x.dtype)
        return (out if self.latent_out is None else self.linear(out, self.latent_out)) + self.shared(x)


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.norm = empty_param(config.hidden_size, dtype=dtype)
        layout = config.mamba
        self.kind = layout.layer_types[layer]
        self.mixer = Mamba2Mixer(config, kernels, dtype, layout.mamba_layers.index(layer)) if self.kind == MAMBA \
            else Attention(config, kernels, dtype, None) if self.kind == ATTENTION \
            else SquaredReLUExperts(config, kernels, dtype) if self.kind == MOE \
            else SquaredReLUMLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        x = self.rms_norm(h, self.norm, self.eps)
        if self.kind == MAMBA:
            return h + self.mixer(x, meta)
        if self.kind == ATTENTION:
            return h + self.mixer(x, cos, sin, kv_cache, meta)
        return h + self.mixer(x)


class NemotronHForCausalLM(HybridForward):
    serves_loras = True  # on its attention, Mamba-2 and dense MLP blocks' mixers (not its experts)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return NemotronHBlock(self.config, self.kernels, dtype, layer)

    def lora_target(self, module: str) -> Target | None:
        """`model.layers.N.mixer.PROJ` (`backbone.` as released), a Mamba-2 block's, an attention block's or a dense
        MLP block's projection by the block's kind."""
        return super().lora_target("model." + module.removeprefix("backbone.") if module.startswith("backbone.")
                                   else module)

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        block = self.layers[layer]
        if place != "mixer" or block.kind == MOE:
            return None
        if block.kind in (MAMBA, ATTENTION):
            return super()._lora_rows(layer, "mamba" if block.kind == MAMBA else "self_attn", proj)
        return {"up_proj": (layer, "up", 0, block.mixer.up_weight.shape[0]),
                "down_proj": (layer, "down", 0, self.config.hidden_size)}.get(proj)

    def is_unused_tensor(self, name: str) -> bool:
        # Nemotron 3's multi-token prediction layer (mtp.*: engine/models/nemotron_h_mtp.py), which transformers leaves
        # unread too.
        return name.startswith("mtp.") or super().is_unused_tensor(name)

    def checkpoint_names(self) -> list[str]:
        names = ["model.embeddings.weight", "model.norm_f.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i, block in enumerate(self.layers):
            p = f"model.layers.{i}."
            names.append(p + "norm.weight")
            if block.kind == MAMBA:
                names += [p + f"mixer.{name}" for name in block.mixer.tensor_names()]
            elif block.kind == ATTENTION:
                names += [p + f"mixer.{x}_proj.weight" for x in "qkvo"]
            elif block.kind == MOE:
                names += [p + f"mixer.{name}" for name in self._expert_names(block.mixer)]
            else:
                names += [p + f"mixer.{x}_proj.{kind}" for x in ("up", "down")
                          for kind in (("weight", "bias") if self.config.mlp_bias else ("weight",))]
        return names

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(".mixer.conv1d.weight"):  # [C, 1, K]
            tensor = tensor.squeeze(1)
        return self._target(name), tensor

    def _target(self, name: str) -> torch.Tensor:
        named = {"model.embeddings.weight": self.embed, "model.norm_f.weight": self.norm,
                 "lm_head.weight": self.lm_head}
        if name in named:
            return named[name].data
        parts = name.split(".", 4)  # model, layers, i, norm or mixer, the rest
        block = self.layers[int(parts[2])]
        if parts[3] == "norm":
            return block.norm.data
        leaf = parts[4]
        if block.kind == MAMBA:
            return block.mixer.tensor(leaf)
        if block.kind == ATTENTION:
            attn, cfg = block.mixer, self.config
            q, kv = cfg.q_size, cfg.kv_size
            rows = {"q_proj.weight": (0, q), "k_proj.weight": (q, q + kv), "v_proj.weight": (q + kv, q + 2 * kv)}
            if leaf == "o_proj.weight":
                return attn.o_weight.data
            lo, hi = rows[leaf]
            return attn.qkv_weight.data[lo:hi]
        if block.kind == MOE:
            return self._expert_target(block.mixer, leaf)
        mlp = block.mixer
        return {"up_proj.weight": mlp.up_weight, "down_proj.weight": mlp.down_weight, "up_proj.bias": mlp.up_bias,
                "down_proj.bias": mlp.down_bias}[leaf].data

    @staticmethod
    def _expert_names(experts: SquaredReLUExperts) -> list[str]:
        names = ["gate.weight", "gate.e_score_correction_bias", "shared_experts.up_proj.weight",
                 "shared_experts.down_proj.weight"]
        names += [f"experts.{e}.{x}_proj.weight" for e in range(experts.moe.num_experts) for x in ("up", "down")]
        return names + (["fc1_latent_proj.weight", "fc2_latent_proj.weight"] if experts.latent_in is not None else [])

    @staticmethod
    def _expert_target(experts: SquaredReLUExperts, leaf: str) -> torch.Tensor:
        parts = leaf.split(".")
        if parts[0] == "experts":  # experts.{e}.up_proj.weight
            return (experts.up_weight if parts[2] == "up_proj" else experts.down_weight).data[int(parts[1])]
        if parts[0] == "shared_experts":
            return (experts.shared.up_weight if parts[1] == "up_proj" else experts.shared.down_weight).data
        return {"gate.weight": experts.router_weight, "gate.e_score_correction_bias": experts.router_bias,
                "fc1_latent_proj.weight": experts.latent_in, "fc2_latent_proj.weight": experts.latent_out}[leaf].data
