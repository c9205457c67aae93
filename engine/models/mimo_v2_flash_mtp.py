"""The multi-token prediction layers MiMo-V2-Flash checkpoints carry under `model.mtp.layers.` (vLLM's and SGLang's
`{"method": "mtp"}`; engine/eagle.py drafts with it as with an EAGLE head). Baton drafts with the first, as vLLM's
MiMo-V2-Flash drafter does; the others are left unread.

At position q it reads the token at q + 1 and the target's last (normed) hidden state at q, each RMS-normed
(`enorm`, `hnorm`), joined by `eh_proj`, through one sliding-window decoder layer of the model's own kind (its KV
heads, sinks, narrower and scaled values, the sliding layers' RoPE) with a dense MLP behind `pre_mlp_layernorm`;
`final_layernorm` norms the output, which makes logits through the target's LM head and is itself the next draft's
hidden state. Its embeddings and LM head are the target's (read whole beside a target split across ranks, each
holding a share of them); no position's embedding is zeroed.
"""
from __future__ import annotations

import torch

from engine.model_config import ModelConfig
from engine.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from engine.models.mtp import LayerUnderPrefix, joined_head_config


class MiMoV2FlashMTP(LayerUnderPrefix, MiMoV2FlashForCausalLM):
    layer_prefix = "model.mtp.layers.0."
    renames = (*MiMoV2FlashForCausalLM.renames, (".pre_mlp_layernorm.", ".post_attention_layernorm."))

    def _is_sparse(self, layer: int) -> bool:
        return False  # its MLP is dense, intermediate_size wide, wherever the model's first is not

    def _own_names(self) -> dict[str, torch.Tensor]:
        p = self.layer_prefix
        return {p + "enorm.weight": self.embedding_norm, p + "hnorm.weight": self.hidden_norm,
                p + "eh_proj.weight": self.fc_weight, p + "final_layernorm.weight": self.norm}


def mimo_v2_flash_mtp_config(raw: dict, target: ModelConfig, reads_vocabulary: bool = False) -> ModelConfig:
    """The head's ModelConfig: the target's, of its one sliding-window layer (config.json's `raw` says no more)."""
    return joined_head_config(target, "MiMoV2FlashMTP", reads_vocabulary, sliding_layers=frozenset({0}))
