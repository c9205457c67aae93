"""The multi-token prediction layers Xiaomi MiMo checkpoints (MiMoForCausalLM: Qwen2's model) carry under
`model.mtp_layers.` (vLLM's `{"method": "mtp"}`, once `mimo_mtp`; engine/eagle.py drafts with it as with an EAGLE
head). Baton drafts with the first, as vLLM does; the others are left unread.

At position q it reads the token at q + 1 (zeroed at position 0, as vLLM's layer zeroes it) and the target's last
(normed) hidden state at q, each RMS-normed (`token_layernorm`, `hidden_layernorm`), joined by `input_proj` (the
hidden state's half first), through one Qwen2 decoder layer; `final_layernorm` norms the output, which makes logits
through the target's LM head and is itself the next draft's hidden state. Its embeddings and LM head are the
target's (read whole beside a target split across ranks, each holding a share of them).
"""
from __future__ import annotations

import torch

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.mtp import LayerUnderPrefix, joined_head_config


class MiMoMTP(LayerUnderPrefix, LlamaForCausalLM):
    layer_prefix = "model.mtp_layers.0."
    hidden_first = True

    def _own_names(self) -> dict[str, torch.Tensor]:
        p = self.layer_prefix
        return {p + "token_layernorm.weight": self.embedding_norm, p + "hidden_layernorm.weight": self.hidden_norm,
                p + "input_proj.weight": self.fc_weight, p + "final_layernorm.weight": self.norm}


def mimo_mtp_config(raw: dict, target: ModelConfig, reads_vocabulary: bool = False) -> ModelConfig:
    """The head's ModelConfig: the target's, of its one layer (a full-attention one; config.json's `raw` says no
    more)."""
    return joined_head_config(target, "MiMoMTP", reads_vocabulary, masks_first=True, sliding_layers=frozenset())
