"""TII's Falcon-H1 (FalconH1ForCausalLM: 0.5B to 34B, Falcon-H1R): in every layer attention and a Mamba-2 layer side
by side, reading the same normed input, their outputs summed into the residual; then a SwiGLU MLP. Its attention
layers have pages, its Mamba-2 layers keep states (engine/models/hybrid.py, engine/mamba_config.py).

Its muP multipliers (engine/falcon_h1_config.py) are folded into the weights as they load: attention's input into
q, k and v, k's into k, attention's output into o; the Mamba-2 layer's input into its projection, whose z, x, B, C
and dt rows take their own, its output into out_proj; the MLP's into gate and down. The embeddings are scaled as
they are read, the logits as they are made; a LoRA adapter's B rows as its projection's weight rows. Checkpoint names
are read as Llama's where the layers are.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.bamba import BambaForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, Attention
from engine.models.mamba2 import Mamba2Mixer
from engine.models.parameters import empty_param
from engine.weights import renamed
from kernels.registry import Kernels


class ParallelLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.attn = Attention(config, kernels, dtype, None)
        self.mamba = Mamba2Mixer(config, kernels, dtype, layer)  # (every layer has one: its index is the layer's)
        self.mlp = MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        x = self.rms_norm(h, self.input_norm, self.eps)
        h = h + self.attn(x, cos, sin, kv_cache, meta) + self.mamba(x, meta)
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))


class FalconH1ForCausalLM(BambaForCausalLM):  # (Bamba's names, and its Mamba-2 layers' tensors)
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return ParallelLayer(self.config, self.kernels, dtype, layer)

    def _attention_names(self, layer: int) -> list[str]:
        # Both kinds a layer: Llama's attention names (Bamba's would give a Mamba-2 layer's alone), then its Mamba-2's.
        mamba = [f"model.layers.{layer}.mamba.{name}" for name in self.layers[layer].mamba.tensor_names()]
        return LlamaForCausalLM._attention_names(self, layer) + mamba

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, self._scaled(name, tensor)) for name, tensor in tensors)

    def _scaled(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor `name` times the multipliers its outputs (or, a weight, its inputs) take."""
        mup, leaf = self.config.mup, name.split(".", 3)[-1]
        is_weight = name.endswith(".weight")
        scale = {"self_attn.q_proj.weight": mup.attention_in, "self_attn.k_proj.weight": mup.attention_in * mup.key,
                 "self_attn.k_proj.bias": mup.key, "self_attn.v_proj.weight": mup.attention_in,
                 "self_attn.o_proj.weight": mup.attention_out, "self_attn.o_proj.bias": mup.attention_out,
                 "mamba.out_proj.weight": mup.ssm_out, "mamba.out_proj.bias": mup.ssm_out,
                 "mlp.gate_proj.weight": mup.mlp_gate, "mlp.gate_proj.bias": mup.mlp_gate,
                 "mlp.down_proj.weight": mup.mlp_down, "mlp.down_proj.bias": mup.mlp_down}.get(leaf)
        if scale is not None:
            return tensor * scale
        if leaf.startswith("mamba.in_proj."):
            rows = self._in_proj_rows(tensor)
            return (tensor * mup.ssm_in if is_weight else tensor) * rows.view(-1, *([1] * (tensor.dim() - 1)))
        return tensor

    def lora_matrices(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's B rows times the multipliers its projection's weight rows take, as they load: its delta
        scaled as the projection's output is."""
        a, b = super().lora_matrices(module, a, b)
        return a, self._scaled(renamed(module + ".", self.renames) + "weight", b)

    def _in_proj_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Each row of the Mamba-2 projection's multiplier: z's, x's, B's, C's and dt's, in turn."""
        m, mup = self.config.mamba, self.config.mup
        groups = m.num_groups * m.state_size
        sizes = (m.intermediate_size, m.intermediate_size, groups, groups, m.num_heads)
        return torch.cat([torch.full((size,), scale, dtype=tensor.dtype) for size, scale in zip(sizes, mup.ssm)])

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return h * self.config.mup.embedding

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.config.mup.lm_head
