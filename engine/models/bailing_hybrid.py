"""inclusionAI's Ling 3 (BailingHybridForCausalLM; engine/bailing_hybrid_config.py): Kimi-Linear's model
(engine/models/kimi_linear.py) with its KDA layers' forget and output gates each one full projection (`f_proj`,
`g_proj`), the forget gate's log bounded below as lower_bound * sigmoid(exp(A_log) (f_proj x + dt_bias)) where
kda_safe_gate says; its latent attention layers with RoPE (DeepSeek's interleaved pairs) and each head's output
weighed by a sigmoid of its own (`g_proj`, a number a head); DeepSeek-V3's experts, named as DeepSeek-V3's are.
Its checkpoints keep the layers' attention under `attention.` and its output projection as `dense`, the embeddings as
`word_embeddings`, the routers' learnt bias as `expert_bias`.
"""
from __future__ import annotations

import torch

from engine.models.kimi_linear import KimiDeltaAttention, KimiLinearForCausalLM
from engine.models.parameters import empty_param

TENSORS = {"f_proj.weight": "f_weight", "dt_bias": "dt_bias", "A_log": "a_log", "b_proj.weight": "b_weight",
           "gate_proj.weight": "g_weight", "o_norm.weight": "o_norm", "o_proj.weight": "o_weight"}


class FullGateDeltaAttention(KimiDeltaAttention):
    tensors = TENSORS

    def _make_gates(self, hidden: int, width: int, head_dim: int, dtype: torch.dtype) -> None:
        self.f_weight = empty_param(width, hidden, dtype=dtype)
        self.g_weight = empty_param(width, hidden, dtype=dtype)

    def _forget_gate_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.f_weight)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.g_weight)


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    # (both kinds of layer's `g_proj` read as a gate_proj: the KDA layers' output gate, the MLA layers' heads')
    renames = (("model.word_embeddings.", "model.embed_tokens."), (".attention.dense.", ".self_attn.o_proj."),
               (".attention.", ".self_attn."), (".self_attn.g_proj.", ".self_attn.gate_proj."),
               (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))
    delta_attention = FullGateDeltaAttention

    def _mlp_names(self, layer: int) -> list[str]:
        return super(KimiLinearForCausalLM, self)._mlp_names(layer)  # DeepSeek-V3's, not Kimi-Linear's
