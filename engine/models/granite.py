"""IBM Granite (GraniteForCausalLM, Granite 3; GraniteMoeForCausalLM and GraniteMoeSharedForCausalLM, Granite 3.0/3.1
MoE; GraniteSWAForCausalLM and GraniteMoeSWAForCausalLM, with windows, sinks and RoPE by layer as their ModelConfig
says, the MoE's tensors as transformers 5 names them): Llama with four scalings of its own, read into ModelConfig:
embeddings times `embedding_multiplier`, each block's output times `residual_multiplier` before it joins the
residual, q·k scaled by `attention_multiplier` (its attention_scale), logits divided by `logits_scaling`. The MoE's
experts are stored fused (`input_linear`: gate and up, `output_linear`: down), as is its shared MLP, beside a router
(`router.layer`). Granite 4.0's (GraniteMoeHybridForCausalLM) name their dense MLP so (`shared_mlp`), their layers
NoPE where `position_embedding_type` says; 4.0-H's Mamba-2 layers (engine/models/mamba2.py) keep states in place of
pages (engine/models/hybrid.py), its attention layers' pages at their places in the pool."""
from __future__ import annotations

import torch
from torch import nn

from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import MLP, DecoderLayer
from engine.models.mamba2 import Mamba2Mixer
from engine.models.parameters import empty_param
from engine.moe_config import GRANITE_HYBRID, GRANITE_SWAS
from kernels.registry import Kernels


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 is_sparse: bool) -> None:
        super().__init__(config, kernels, dtype, sliding_window, is_sparse)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, h, cos, sin, kv_cache, meta):
        scale = self.residual_multiplier
        h = h + self.attn(self.rms_norm(h, self.input_norm, self.eps), cos, sin, kv_cache, meta) * scale
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps)) * scale


class PeriNormGraniteLayer(GraniteDecoderLayer):
    """HyperCLOVA X's Peri-LN: each block's output RMS-normed too, before it is scaled into the residual."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 is_sparse: bool) -> None:
        super().__init__(config, kernels, dtype, sliding_window, is_sparse)
        self.attn_out_norm = empty_param(config.hidden_size, dtype=dtype)
        self.mlp_out_norm = empty_param(config.hidden_size, dtype=dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        scale, norm, eps = self.residual_multiplier, self.rms_norm, self.eps
        attended = self.attn(norm(h, self.input_norm, eps), cos, sin, kv_cache, meta)
        h = h + norm(attended, self.attn_out_norm, eps) * scale
        return h + norm(self.mlp(norm(h, self.post_attention_norm, eps)), self.mlp_out_norm, eps) * scale


class GraniteMambaLayer(GraniteDecoderLayer):
    """Granite 4.0-H's Mamba-2 layer in place of attention; `index`: its place among the Mamba-2 layers."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, is_sparse: bool, index: int) -> None:
        super().__init__(config, kernels, dtype, None, is_sparse)
        self.attn = Mamba2Mixer(config, kernels, dtype, index)

    def forward(self, h, cos, sin, kv_cache, meta):
        scale = self.residual_multiplier
        h = h + self.attn(self.rms_norm(h, self.input_norm, self.eps), meta) * scale
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps)) * scale


# HyperCLOVA X's norms of its blocks' outputs, by their places in PeriNormGraniteLayer.
POST_BLOCK_NORMS = {"post_norm1": "attn_out_norm", "post_norm2": "mlp_out_norm"}

# The MoE's tensors, by where they go in SparseMoE.
MOE_TENSORS = {"block_sparse_moe.input_linear.weight": "gate_up_weight",
               "block_sparse_moe.output_linear.weight": "down_weight",
               "block_sparse_moe.router.layer.weight": "router_weight",
               "shared_mlp.input_linear.weight": "shared_gate_up_weight",
               "shared_mlp.output_linear.weight": "shared_down_weight"}

# Granite SWA's MoE as transformers 5 saves it (its own names for the same tensors).
MOE_SWA_RENAMED = (("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
                   ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
                   ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"))


class GraniteForCausalLM(HybridForward):
    splits_across_ranks = True  # but with Mamba layers (tensor_parallel.check_shardable refuses recurrent layers)
    serves_loras = True  # on its attention, its Mamba-2 layers' projections in and out, its dense (shared) MLPs

    @property
    def renames(self) -> tuple[tuple[str, str], ...]:
        return MOE_SWA_RENAMED if self.config.architecture == GRANITE_SWAS[1] else ()

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        mamba = self.config.mamba
        if mamba is not None and layer in mamba.mamba_layers:
            return GraniteMambaLayer(self.config, self.kernels, dtype, self._is_sparse(layer),
                                     mamba.mamba_layers.index(layer))
        kind = PeriNormGraniteLayer if self.config.block_post_norms else GraniteDecoderLayer
        return kind(self.config, self.kernels, dtype, self._window(layer), self._is_sparse(layer))

    def _attention_names(self, layer: int) -> list[str]:
        mamba = self.config.mamba
        if mamba is None or layer not in mamba.mamba_layers:
            return super()._attention_names(layer)
        return [f"model.layers.{layer}.mamba.{name}" for name in self.layers[layer].attn.tensor_names()]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(".mamba.conv1d.weight"):  # [C, 1, K]
            tensor = tensor.squeeze(1)
        return super()._placed(name, tensor)

    def _mlp_names(self, layer: int) -> list[str]:
        if not self._is_sparse(layer) and self.config.architecture == GRANITE_HYBRID:  # its dense MLP, fused
            return [f"model.layers.{layer}.shared_mlp.{x}.weight" for x in ("input_linear", "output_linear")]
        if not self._is_sparse(layer):
            return super()._mlp_names(layer)
        shared = self.config.moe.shared_expert_intermediate_size
        return [f"model.layers.{layer}.{name}" for name in MOE_TENSORS if shared or not name.startswith("shared")]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[3].removesuffix(".weight") in POST_BLOCK_NORMS:
            return getattr(self.layers[int(parts[2])], POST_BLOCK_NORMS[parts[3].removesuffix(".weight")]).data
        if len(parts) == 4 and parts[3].startswith("mamba."):
            return self.layers[int(parts[2])].attn.tensor(parts[3].removeprefix("mamba."))
        if len(parts) == 4 and parts[3] in MOE_TENSORS:
            mlp = self.layers[int(parts[2])].mlp
            if isinstance(mlp, MLP):  # Granite 4.0's dense MLP under the shared MLP's names
                return (mlp.gate_up_weight if "input_linear" in parts[3] else mlp.down_weight).data
            return getattr(mlp, MOE_TENSORS[parts[3]]).data
        return super()._target(name)

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        if place == "shared_mlp" and isinstance(self.layers[layer].mlp, MLP):  # 4.0-H's dense MLP, gate and up fused
            return super()._lora_rows(layer, "mlp", {"input_linear": "gate_up_proj",
                                                     "output_linear": "down_proj"}.get(proj, ""))
        return super()._lora_rows(layer, place, proj)

    def _norm_names(self) -> tuple[str, ...]:
        return (*super()._norm_names(), *POST_BLOCK_NORMS) if self.config.block_post_norms else super()._norm_names()

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return h * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
