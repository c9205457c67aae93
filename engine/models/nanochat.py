"""NanoChat (NanoChatForCausalLM: Karpathy's nanochat as transformers holds it): Llama's layers with RMS norms that
have no weights (the embeddings normed too, before the first layer), q and k normed a head after RoPE, RoPE turning
the other way (its rotate_half negates the other half), an ungated MLP of squared ReLU (`fc1`, `fc2`), and its logits
soft-capped."""
from __future__ import annotations

import torch

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from kernels.registry import Kernels


class NanoChatForCausalLM(LlamaForCausalLM):
    renames = (("mlp.fc1.", "mlp.up_proj."), ("mlp.fc2.", "mlp.down_proj."))

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.final_softcap = config.final_logit_softcapping
        with torch.no_grad():  # norms without weights: scaled by ones
            for norm in (self.norm, *(p for layer in self.layers for p in (
                    layer.input_norm, layer.post_attention_norm, layer.attn.q_norm, layer.attn.k_norm))):
                norm.fill_(1.0)

    def _register_ropes(self, max_positions: int) -> None:
        super()._register_ropes(max_positions)
        self.rope_sin.neg_()  # its rotation by -angle: (x2, -x1) for Llama's (-x2, x1)

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(h, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def checkpoint_names(self) -> list[str]:
        return [name for name in super().checkpoint_names() if not name.endswith("norm.weight")]

    def _norm_names(self) -> tuple[str, ...]:
        return ()
